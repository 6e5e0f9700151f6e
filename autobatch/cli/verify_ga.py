"""``autobatch verify-ga``: does micro batch × accumulation give the big batch's gradient?"""

from __future__ import annotations

import typer

from ._app import command
from .options import ModelSpec, SeqLen

__all__ = ["verify_ga_command"]


@command("verify-ga")
def verify_ga_command(
    model: ModelSpec,
    micro_batch: int = typer.Option(..., "--micro-batch", help="Samples per micro-batch per rank."),
    grad_accum: int = typer.Option(..., "--grad-accum", help="Micro-batches accumulated per optimizer step."),
    world_size: int = typer.Option(1, "--world-size", help="Data-parallel ranks, simulated in this process."),
    seq_len: SeqLen = None,
    normalised: bool = typer.Option(
        False, "--normalised/--naive",
        help="Check autobatch's token-normalised loss, or (default) the naive mean per micro-batch / GA.",
    ),
    tolerance: float = typer.Option(1e-5, "--tolerance", help="Largest overall relative gradient error that passes."),
    seed: int = typer.Option(0, "--seed", help="Seed for the weights, the batch and every forward pass."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Does micro-batch x GA (x ranks) give the big batch's gradient? Exit 0 PASS, 1 FAIL, 3 FLAGGED."""
    import json

    from ..checking.ga_sources import verify_model

    result = verify_model(
        model, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
        mode="normalised" if normalised else "naive", tolerance=tolerance, seed=seed,
    )
    # ensure_ascii=False: the cause reads "2.5× more", not "2.5\u00d7 more".
    typer.echo(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) if as_json else str(result))
    if result.exit_code:
        raise typer.Exit(result.exit_code)
