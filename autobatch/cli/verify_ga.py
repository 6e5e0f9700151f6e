"""``autobatch verify-ga``: does micro batch × accumulation give the big batch's gradient?"""

from __future__ import annotations

import typer

from ._app import command
from .options import AsJson, InputShape, ModelSpec, Nodes, NumClasses, SeqLen, TrustRemoteCode, model_load_options

__all__ = ["verify_ga_command"]


@command("verify-ga", examples=[
    "autobatch verify-ga --model tiny-gpt2 --micro-batch 2 --grad-accum 4 --normalised",
    "autobatch verify-ga --model tiny-llama --micro-batch 1 --grad-accum 4 --gpus 2",
])
def verify_ga_command(
    model: ModelSpec,
    micro_batch: int = typer.Option(..., "--micro-batch", min=1, rich_help_panel="Plan", help="Samples per micro-batch per rank."),
    grad_accum: int = typer.Option(..., "--grad-accum", min=1, rich_help_panel="Plan",
                                   help="Micro-batches accumulated per optimizer step."),
    gpus: int = typer.Option(1, "--gpus", min=1, rich_help_panel="Plan",
                             help="GPUs per node (world size = --gpus × --nodes), simulated as ranks in this process."),
    nodes: Nodes = 1,
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    num_classes: NumClasses = 10,
    trust_remote_code: TrustRemoteCode = False,
    normalised: bool = typer.Option(
        False, "--normalised/--naive", show_default="--naive",
        help="Check autobatch's token-normalised loss, or the naive mean per micro-batch / GA.",
    ),
    tolerance: float = typer.Option(1e-5, "--tolerance", min=0.0, help="Largest overall relative gradient error that passes."),
    seed: int = typer.Option(0, "--seed", help="Seed for the weights, the batch and every forward pass."),
    as_json: AsJson = False,
) -> None:
    """Does micro-batch × GA (× ranks) give the big batch's gradient? Exit 0 PASS, 1 FAIL, 3 FLAGGED."""
    import json

    from .. import verify_ga_model as verify_model

    result = verify_model(
        model, micro_batch=micro_batch, grad_accum=grad_accum, world_size=gpus * nodes,
        mode="normalised" if normalised else "naive", tolerance=tolerance, seed=seed,
        **model_load_options(seq_len, input_shape, num_classes, trust_remote_code),
    )
    # ensure_ascii=False: the cause reads "2.5× more", not "2.5\u00d7 more".
    typer.echo(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) if as_json else str(result))
    if result.exit_code:
        raise typer.Exit(result.exit_code)
