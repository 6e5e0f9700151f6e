"""The memory model across sequence lengths: ``peak(b, s) = m0 + b·(c1·s + c2·s²)``.

Fixed memory ``m0`` (weights, gradients, optimizer state, workspaces) does not depend on the
batch; each sample costs memory linear in its tokens (embeddings, MLP activations, logits) plus
a term quadratic in them (attention scores on the paths that store them). Fitted to the peaks of
trials that fit, at any lengths, it predicts the largest batch at a length not yet tried.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["LengthFit", "fit_lengths"]


@dataclass(frozen=True)
class LengthFit:
    """``peak(b, s) = fixed_bytes + b·(per_token_bytes·s + per_token_pair_bytes·s²)``.

    ``lengths`` are the sequence lengths whose trials the fit rests on. With one length the
    quadratic term cannot be told from the linear one and is taken as zero.

    Example:
        >>> fit = LengthFit(1000.0, 10.0, 0.5, lengths=(8, 16))
        >>> fit.peak(4, 16), fit.max_batch(32, limit=20_000)
        (2152.0, 22)
    """

    fixed_bytes: float
    per_token_bytes: float
    per_token_pair_bytes: float
    lengths: tuple[int, ...]

    def per_sample_bytes(self, seq_len: int) -> float:
        return self.per_token_bytes * seq_len + self.per_token_pair_bytes * seq_len * seq_len

    def peak(self, batch: int, seq_len: int) -> float:
        return self.fixed_bytes + batch * self.per_sample_bytes(seq_len)

    def max_batch(self, seq_len: int, limit: int) -> int:
        """The largest batch whose predicted peak at ``seq_len`` stays within ``limit`` bytes (≥ 0)."""
        per_sample = self.per_sample_bytes(seq_len)
        if per_sample <= 0:
            return 0
        return max(0, int((limit - self.fixed_bytes) // per_sample))

    def to_dict(self) -> dict[str, object]:
        return {"fixed_bytes": self.fixed_bytes, "per_token_bytes": self.per_token_bytes,
                "per_token_pair_bytes": self.per_token_pair_bytes, "lengths": list(self.lengths)}

    def __str__(self) -> str:
        return (f"peak ≈ {self.fixed_bytes:,.0f} + b·({self.per_token_bytes:,.1f}·s + "
                f"{self.per_token_pair_bytes:,.3f}·s²) bytes")


def fit_lengths(points: Mapping[int, Mapping[int, int]]) -> LengthFit | None:
    """Fit the model to measured peaks ``{seq_len: {batch: bytes}}`` of trials that fit.

    Least squares on relative error, so the large peaks near each boundary and the small ones
    weigh alike. ``None`` when the points cannot fix a slope (fewer than two, or every one at
    the same batch and length), or the fit says memory does not grow with the batch.
    """
    if any(s is None for s in points):
        return None  # a row at the workload's own shape has no length to fit
    rows = [(b, s, y) for s, by in points.items() for b, y in by.items() if y > 0]
    if len({(b, s) for b, s, _ in rows}) < 2:
        return None
    lengths = sorted({s for _, s, _ in rows})
    quadratic = len(lengths) >= 2
    a = torch.tensor([[1.0, b * s] + ([b * s * s] if quadratic else []) for b, s, _ in rows], dtype=torch.float64)
    y = torch.tensor([float(v) for _, _, v in rows], dtype=torch.float64)
    weights = y / y.max()
    scale = a.abs().max(dim=0).values.clamp_min(1.0)  # columns span 1 … b·s²: keep the solve well conditioned
    solution = torch.linalg.lstsq((a / scale) * weights[:, None], (y * weights)[:, None]).solution[:, 0] / scale
    m0, c1 = float(solution[0]), float(solution[1])
    c2 = float(solution[2]) if quadratic else 0.0
    fit = LengthFit(m0, c1, c2, tuple(lengths))
    if any(fit.per_sample_bytes(s) <= 0 for s in lengths):
        return None
    return fit
