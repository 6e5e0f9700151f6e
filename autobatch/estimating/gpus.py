"""A catalogue of common GPUs: how much memory a training step can use on each.

``total_bytes`` is the memory the driver reports for the card (``torch.cuda.get_device_properties
(i).total_memory``, a little under the marketing figure because ECC and the driver keep some).
``context_bytes`` is what the CUDA/ROCm context of one process takes before the first tensor
(kernels of torch, cuBLAS, cuDNN loaded lazily); the probe measures its capacity after that, so
``usable_bytes = total_bytes - context_bytes`` is the figure an estimate compares peaks with.

The context sizes are typical values with lazy module loading (CUDA ≥ 11.7, the default in
torch): 300–600 MiB depending on the card and driver, and the H200's as measured there (770 MiB
once a model has trained: kernels load as they are first used). They are assumptions, not
measurements of your machine: ``--cuda-context`` (``Request.cuda_context``) sets yours, and
``docs/estimate.md`` lists where each figure comes from.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import AutobatchError
from ..units import format_bytes, parse_bytes

__all__ = ["GpuSpec", "GPUS", "DEFAULT_GPU", "DEFAULT_CONTEXT_BYTES", "PEAK_TFLOPS", "PEAK_TFLOPS_FP32", "peak_tflops", "lacks_bf16", "lookup_gpu", "custom_gpu",
           "resolve_gpu", "gpu_mix"]

_MIB = 1 << 20
_GIB = 1 << 30
DEFAULT_GPU = "a100-80gb"
DEFAULT_CONTEXT_BYTES = 500 * _MIB  # a card not in the catalogue: the middle of the 300–600 MiB range


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model, as far as memory goes.

    Args:
        name: the catalogue name, e.g. ``"a100-80gb"``.
        total_bytes: memory the driver reports for the card.
        context_bytes: memory the CUDA/ROCm context takes per process before any tensor.
        vendor: ``"nvidia"``, ``"amd"`` or ``"custom"``.
        notes: where the figures come from, or what to watch for.
        aliases: other spellings accepted by :func:`lookup_gpu`.

    Example:
        >>> lookup_gpu("H100").usable_bytes == lookup_gpu("h100-80gb").usable_bytes
        True
    """

    name: str
    total_bytes: int
    context_bytes: int
    vendor: str
    notes: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    @property
    def usable_bytes(self) -> int:
        return self.total_bytes - self.context_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("aliases")
        data["usable_bytes"] = self.usable_bytes
        return data

    def __str__(self) -> str:
        return (
            f"{self.name:<11} {format_bytes(self.total_bytes):>11} total  "
            f"{format_bytes(self.usable_bytes):>11} usable  {self.vendor:<6} {self.notes}"
        )


def _gib(x: float) -> int:
    return int(x * _GIB)


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("v100-16gb", _gib(15.77), 400 * _MIB, "nvidia", "Volta; no bf16 (autocast bf16 is emulated)", ("v100",)),
        GpuSpec("v100-32gb", _gib(31.74), 400 * _MIB, "nvidia", "Volta; no bf16 (autocast bf16 is emulated)"),
        GpuSpec("t4", _gib(14.75), 350 * _MIB, "nvidia", "Turing 16 GB with ECC on; no bf16"),
        GpuSpec("a10g", _gib(22.20), 450 * _MIB, "nvidia", "Ampere 24 GB (AWS g5)", ("a10",)),
        GpuSpec("l4", _gib(22.03), 450 * _MIB, "nvidia", "Ada 24 GB (GCP g2)"),
        GpuSpec("rtx-3090", _gib(23.69), 450 * _MIB, "nvidia", "Ampere 24 GB; the desktop also draws here", ("3090",)),
        GpuSpec("rtx-4090", _gib(23.64), 450 * _MIB, "nvidia", "Ada 24 GB; the desktop also draws here", ("4090",)),
        GpuSpec("a100-40gb", _gib(39.39), 500 * _MIB, "nvidia", "Ampere 40 GB"),
        GpuSpec("a100-80gb", _gib(79.15), 500 * _MIB, "nvidia", "Ampere 80 GB (the default GPU)"),
        GpuSpec("h100-80gb", _gib(79.19), 550 * _MIB, "nvidia", "Hopper 80 GB (SXM; PCIe is within 0.1 GiB)", ("h100",)),
        # measured: 0.60 GiB once CUDA started, 0.74–0.76 GiB once a model trained (torch 2.11, CUDA 13.0;
        # docs/benchmarks/peaks.md); with it the estimate answers what find answered on the card, four of four
        GpuSpec("h200", _gib(139.80), 770 * _MIB, "nvidia", "Hopper 141 GB", ("h200-141gb",)),
        GpuSpec("mi250", _gib(64.0), 400 * _MIB, "amd", "per GCD: an MI250 is two devices of 64 GB", ("mi250x",)),
        GpuSpec("mi300x", _gib(192.0), 500 * _MIB, "amd", "CDNA3 192 GB"),
    )
}


# Peak dense tensor-core TFLOPS in the 16-bit format each card trains in (bf16; fp16 on V100 and T4,
# which have no bf16), from the vendors' datasheets and architecture whitepapers (MI250: one GCD,
# half the card). Only their ratios are used: to split samples between mixed GPUs by speed in an
# estimate (``estimate --gpu a100-80gb:4,v100-32gb:4 --uneven``), where nothing can be timed.
PEAK_TFLOPS: dict[str, float] = {
    "v100-16gb": 125.0, "v100-32gb": 125.0, "t4": 65.0, "a10g": 125.0, "l4": 121.0, "rtx-3090": 71.0,
    "rtx-4090": 165.2, "a100-40gb": 312.0, "a100-80gb": 312.0, "h100-80gb": 989.0, "h200": 989.0,
    "mi250": 181.0, "mi300x": 1307.0,
}

# Peak dense FP32 TFLOPS, from the same datasheets: what a card runs full-precision matmuls at with
# PyTorch's default (TF32 off for matmuls: ``torch.backends.cuda.matmul.allow_tf32`` is False), on
# NVIDIA's FP32 cores; AMD's FP32 matrix cores, which rocBLAS takes for FP32 GEMMs (MI250: one GCD).
# The A100 is 312 against the V100's 125 in 16 bits, but 19.5 against 15.7 in FP32: an fp32 job
# split by the 16-bit figures would give the A100 twice the share its speed earns.
PEAK_TFLOPS_FP32: dict[str, float] = {
    "v100-16gb": 15.7, "v100-32gb": 15.7, "t4": 8.1, "a10g": 31.2, "l4": 30.3, "rtx-3090": 35.6,
    "rtx-4090": 82.6, "a100-40gb": 19.5, "a100-80gb": 19.5, "h100-80gb": 67.0, "h200": 67.0,
    "mi250": 45.3, "mi300x": 163.4,
}


def lacks_bf16(spec: GpuSpec, precision: str | None) -> bool:
    """Whether ``precision`` asks bf16 (autocast or pure weights) of a card that has none (V100, T4: emulated).

    Example:
        >>> lacks_bf16(GPUS["v100-32gb"], "bf16-true"), lacks_bf16(GPUS["a100-80gb"], "bf16"), lacks_bf16(GPUS["t4"], None)
        (True, False, False)
    """
    return (precision or "").startswith("bf16") and "no bf16" in spec.notes


def peak_tflops(name: str, precision: str | None) -> tuple[float | None, str]:
    """A card's peak dense TFLOPS in the format a job trains in, and that format's name.

    ``precision`` is a request's (``None`` for full fp32; ``"bf16"``, ``"fp16"``, ``"bf16-true"``,
    …): fp32 takes :data:`PEAK_TFLOPS_FP32`, every 16-bit precision :data:`PEAK_TFLOPS`, except bf16
    on a card without it (V100, T4), which emulates it no faster than fp32.
    ``None`` for a card not in the table.

    Example:
        >>> peak_tflops("a100-80gb", None), peak_tflops("a100-80gb", "bf16"), peak_tflops("v100-32gb", "bf16")
        ((19.5, 'fp32'), (312.0, '16-bit'), (15.7, 'fp32: no bf16 on this card'))
    """
    spec = GPUS.get(name)
    if spec is not None and lacks_bf16(spec, precision):
        return PEAK_TFLOPS_FP32.get(name), "fp32: no bf16 on this card"
    if precision is None:
        return PEAK_TFLOPS_FP32.get(name), "fp32"
    return PEAK_TFLOPS.get(name), "16-bit"


def gpu_mix(gpu: str | None) -> tuple[tuple[GpuSpec, int], ...] | None:
    """The cards of a mixed job, ``"a100-80gb:4,a100-40gb:4"``, in rank order; ``None`` for one plain name.

    Raises:
        AutobatchError: a part that is not ``NAME`` or ``NAME:COUNT`` with a positive count.

    Example:
        >>> [(spec.name, n) for spec, n in gpu_mix("a100-80gb:4, v100:2")]
        [('a100-80gb', 4), ('v100-16gb', 2)]
    """
    if not isinstance(gpu, str) or ("," not in gpu and ":" not in gpu):
        return None
    mix = []
    parts = gpu.split(",")
    for part in parts:
        name, _, count = part.strip().partition(":")
        count = count.strip() or ("" if len(parts) > 1 else "1")
        if not count.isdigit() or int(count) < 1:
            raise AutobatchError(f"gpu must list NAME:COUNT parts (a100-80gb:4,a100-40gb:4), but got {part.strip()!r} "
                                 f"in {gpu!r}; give each card's count as a positive integer, every card of a list")
        mix.append((lookup_gpu(name.strip()), int(count)))
    return tuple(mix)


def _normalise(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for prefix in ("nvidia", "amd", "instinct", "geforce", "tesla"):
        key = key.removeprefix(prefix)
    return key


def _keys(spec: GpuSpec) -> set[str]:
    keys = {_normalise(n) for n in (spec.name, *spec.aliases)}
    return keys | {k.removesuffix("gb") for k in keys} | {k.removesuffix("gb") + "g" for k in keys if k.endswith("gb")}


_INDEX = {key: spec for spec in GPUS.values() for key in _keys(spec)}


def lookup_gpu(name: str) -> GpuSpec:
    """The catalogue entry for ``name``: case, spaces, hyphens and a vendor prefix do not matter.

    Raises:
        AutobatchError: one line listing the catalogue when the name is unknown.

    Example:
        >>> lookup_gpu("NVIDIA A100 80GB").name
        'a100-80gb'
    """
    spec = _INDEX.get(_normalise(str(name)))
    if spec is None:
        raise AutobatchError(
            f"gpu must be one of {', '.join(GPUS)}, but got {name!r}; "
            "for any other card pass its memory instead (--gpu-memory 40GiB)"
        )
    return spec


def custom_gpu(memory: int | str, *, context_bytes: int = DEFAULT_CONTEXT_BYTES, name: str | None = None) -> GpuSpec:
    """A card that is not in the catalogue, from its total memory (``"40GiB"`` or bytes).

    Example:
        >>> custom_gpu("40GiB").usable_bytes == 40 * 2**30 - 500 * 2**20
        True
    """
    total = parse_bytes(memory)
    if total <= 0:
        raise AutobatchError(f"gpu memory must be positive, but got {memory!r}; pass the card's total memory, e.g. 40GiB")
    return GpuSpec(name or f"custom-{format_bytes(total).replace(' ', '')}", total, context_bytes, "custom",
                   f"--gpu-memory {format_bytes(total)}")


def resolve_gpu(gpu: str | GpuSpec | None = None, gpu_memory: int | str | None = None) -> GpuSpec:
    """The GPU an estimate is for: ``gpu_memory`` wins, else ``gpu`` (name or spec), else the default."""
    if gpu_memory is not None:
        return custom_gpu(gpu_memory)
    if isinstance(gpu, GpuSpec):
        return gpu
    return lookup_gpu(gpu if gpu is not None else DEFAULT_GPU)
