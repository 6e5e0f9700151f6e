"""AdamW with 8-bit states, holding the memory bitsandbytes' ``AdamW8bit`` holds, without bitsandbytes.

bitsandbytes keeps, block-wise (its default; ``Optimizer2State.init_state``), for a parameter of
``n ≥ 4096`` elements (``min_8bit_size``): both moments as ``uint8`` tensors of ``n`` elements and a
``float32`` absmax per block of 256 elements for each, ``2n + 8·⌈n/256⌉`` bytes; for a smaller
parameter both moments in ``float32``, ``8n`` bytes; and, once per optimizer, two quantisation maps
of 256 ``float32`` values. Its update is one fused kernel with no temporaries the size of a
parameter. :class:`EightBitAdamW` allocates the same tensors on each parameter's device when it
first steps it, and updates the weights in place without temporaries: a probe or a trace needs
the optimizer's memory, not its arithmetic (the probed model is given back as it was).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["EightBitAdamW", "MIN_8BIT_SIZE", "BLOCK", "state_bytes"]

MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller parameters keep float32 states
BLOCK = 256           # elements per absmax block (block-wise quantisation)
_QMAP = 256           # entries of each quantisation map


def state_bytes(numel: int) -> int:
    """The bytes ``AdamW8bit`` keeps for one parameter of ``numel`` elements (the maps aside).

    Example:
        >>> state_bytes(16384), state_bytes(128)
        (33280, 1024)
    """
    if numel < MIN_8BIT_SIZE:
        return 2 * 4 * numel
    return 2 * numel + 2 * 4 * -(-numel // BLOCK)


class EightBitAdamW(torch.optim.Optimizer):
    """``--optimizer adamw8bit``: bitsandbytes' ``AdamW8bit`` as memory (see the module's docstring)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-4):
        super().__init__(params, {"lr": lr})
        self.maps: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                p.add_(p.grad, alpha=-group["lr"])
        return None

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        n = p.numel()
        if n < MIN_8BIT_SIZE:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        if not self.maps:
            self.maps = [torch.zeros(_QMAP, dtype=torch.float32, device=p.device) for _ in range(2)]
        blocks = -(-n // BLOCK)
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
