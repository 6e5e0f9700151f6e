"""Options several commands share: one definition each, so their flags and help never drift."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = [
    "Dtype", "DeviceName", "Headroom", "MaxBatch", "MinMicro", "ModelParallel", "ModelSpec", "MultipleOf",
    "Nodes", "OptimizerName", "SeqLen", "SimulatedMemory", "headroom_value",
]

ModelSpec = Annotated[str, typer.Option("--model", help='Built-in name (see `autobatch models`), hf:NAME_OR_DIR, file.py:fn or module:fn.')]
Nodes = Annotated[int, typer.Option("--nodes", help='Number of nodes.')]
ModelParallel = Annotated[int, typer.Option("--model-parallel", help='Tensor × pipeline parallel degree.')]
SeqLen = Annotated[int | None, typer.Option("--seq-len", help='Tokens per sample, the longest you train on.')]
Dtype = Annotated[str, typer.Option("--dtype", help='fp32, bf16 or fp16 (autocast).')]
OptimizerName = Annotated[str, typer.Option("--optimizer", help='adamw, adam, sgd, sgd-nomomentum or adafactor.')]
Headroom = Annotated[str, typer.Option("--headroom", help='Memory kept free for the safe batch: 5%, 0.05 or 2GiB.')]
MaxBatch = Annotated[int | None, typer.Option("--max-batch", help='Never try a per-GPU batch above this.')]
MinMicro = Annotated[int | None, typer.Option("--min-micro", help='Smallest per-GPU batch (default 2 with BatchNorm, else 1).')]
MultipleOf = Annotated[int | None, typer.Option("--multiple-of", help='Per-GPU batch must be a multiple of this.')]
DeviceName = Annotated[str | None, typer.Option("--device", help='cuda, cuda:N, or cpu (with --memory: simulated budget).')]
SimulatedMemory = Annotated[str | None, typer.Option("--memory", help='Simulated device memory for --device cpu, e.g. 2GiB.')]


def headroom_value(text: str) -> float | str:
    """``0.05`` as a fraction; ``5%`` and ``2GiB`` go to the library, which explains a bad value."""
    try:
        return float(text)
    except ValueError:
        return text
