"""Estimating without a GPU: the same trials traced on fake tensors, for a named GPU.

:mod:`.estimate` traces and searches; :mod:`.gpus` is the catalogue of cards; :mod:`.overheads`
holds what a trace cannot see (CUDA context, fragmentation, workspaces).
"""

from __future__ import annotations

from .estimate import Estimate, estimate
from .gpus import GPUS, GpuSpec, lookup_gpu
from .overheads import Overheads

__all__ = ["Estimate", "GPUS", "GpuSpec", "Overheads", "estimate", "lookup_gpu"]
