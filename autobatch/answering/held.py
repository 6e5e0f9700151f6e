"""A plan that accumulates is probed with the gradients held, as its micro-steps train.

Every accumulation micro-step after the first runs its forward with the gradients of the steps before
still allocated (``zero_grad`` comes after the optimizer step, not between micro-steps). A probe of
plain steps frees them before each forward, so its largest batch can run out of memory under the plan
that accumulates it: tiny-mlp on 4 MiB planned 677 × 2, which peaks at 4.11 MiB when trained so. Where
the answer's plan accumulates, :func:`held_again` says to answer again with ``grads_held`` (the
gradients zeroed in place into the next forward, as ``--grads-held`` does).

FSDP and ZeRO keep their gradients as their engines do (sharded, in their own buffers), which their
trials already train with; a plan per rank (``--uneven``) and several strategies compared are answered
as they are. Under a launcher every rank probes again in the same process group (the launcher's, met once).
"""

from __future__ import annotations

from typing import Any

__all__ = ["held_again", "HELD_NOTE"]

# "answered", not "probed": the answer with them held may come from the cache, where nothing runs.
HELD_NOTE = ("the plan the first trials gave ({micro} per GPU × {accum} accumulation) accumulates, and each micro-step "
             "after the first runs its forward with the gradients still allocated: answered again with them held "
             "(--grads-held), so the micro batch fits as it will train")


def held_again(request: Any, report: Any) -> bool:
    """Whether ``report``, answered for ``request``, has a plan that accumulates gradients its trials freed."""
    plan = report.plan
    if plan is None or plan.grad_accum == 1 or request.grads_held or request.micro_batch is not None:
        return False
    if report.uneven is not None or len(report.rows) > 1:
        return False
    return all(s.name == "ddp" for s in request.strategies or ())
