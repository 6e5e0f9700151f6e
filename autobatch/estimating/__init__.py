"""Estimating without a GPU: the same trials traced on fake tensors, for a named GPU.

:mod:`.estimate` traces and searches; :mod:`.gpus` is the catalogue of cards; :mod:`.overheads`
holds what a trace cannot see (CUDA context, fragmentation, workspaces); :mod:`.prior` lends the
trace to the probe's search as a prior.
"""

from __future__ import annotations

from .estimate import Estimate, estimate
from .gpus import GPUS, GpuSpec, lookup_gpu
from .overheads import Overheads
from .prior import trace_prior

__all__ = ["Estimate", "GPUS", "GpuSpec", "Overheads", "estimate", "lookup_gpu", "trace_prior"]
