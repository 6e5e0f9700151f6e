"""Garbage collection between trials at the cost of the probe's own objects, not the whole process's.

A trial drops what it built (DDP's reducer, an FSDP or DeepSpeed engine, the optimizer) with
``gc.collect()``: those objects sit in reference cycles, and on a GPU their memory must be back
before the next trial is measured. A full collection walks every object the process tracks, and
in a process that has imported transformers, DeepSpeed and Lightning that is millions of them:
a few tenths of a second per call, several calls per trial. :func:`frozen_heap` moves every
object alive when the probe starts into the collector's permanent generation (``gc.freeze()``),
so the collections the trials make walk only what the probe itself created, and puts them back
(``gc.unfreeze()``) when the probe ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Run the body with the objects alive now out of its garbage collections; restore on exit.

    Once CUDA is initialised, garbage from before (a previous model that may still hold device
    memory) is collected first, so it does not hold that memory for the body's length; before
    that no tensor on a GPU can exist, and what garbage holds on the host does not count against
    a simulated budget, so the full collection is skipped. A process that has frozen objects of
    its own (a forking server does) is left exactly as it is, and so is a body nested in another
    ``frozen_heap``: ``gc.unfreeze()`` cannot tell their objects from ours.

    Example:
        >>> import gc
        >>> with frozen_heap():
        ...     gc.get_freeze_count() > 0
        True
        >>> gc.get_freeze_count()
        0
    """
    if gc.get_freeze_count():
        yield
        return
    if torch.cuda.is_initialized():
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
