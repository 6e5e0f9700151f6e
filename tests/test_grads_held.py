"""--grads-held: the gradients stay allocated into the next step's forward, as in every accumulation
micro-step after the first, or a loop that zeroes with set_to_none=False. Counted by hand on a
two-layer MLP; carried by the probe, the estimate, DDP's sharded trial and the cache's fingerprint;
refused in one line where an engine keeps its own gradients."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import autobatch
from autobatch import SimulatedBackend, Workload, run_trial
from autobatch.cli import app
from autobatch.tuning.fingerprint import fingerprint


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _batch(b: int):
    return torch.randn(b, 64), torch.randint(0, 10, (b,))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_forward_holds_the_gradients_the_backward_had_not_yet_made(optimizer) -> None:
    def forward_backward(held: bool) -> int:
        work = Workload(_model, _batch, optimizer=optimizer, grads_held=held)
        return run_trial(work, _model(), SimulatedBackend("64MiB"), 32).forward_backward_bytes

    # A plain step peaks in the backward once the last layer's gradients exist (256·10 + 10 floats);
    # held, the first layer's are there too: 64·256 + 256 floats, 66,560 bytes more.
    assert forward_backward(True) - forward_backward(False) == 4 * (64 * 256 + 256)


def test_a_probe_and_an_estimate_fit_less_with_the_gradients_held() -> None:
    def probed(held: bool) -> int:
        return autobatch.probe(Workload(_model, _batch, grads_held=held), SimulatedBackend("1MiB"),
                               headroom=0).max_batch

    def estimated(held: bool) -> int:
        return autobatch.estimate(Workload(_model, _batch, grads_held=held), gpu_memory="1GiB", max_batch=None,
                                  overheads=autobatch.Overheads.none()).max_batch

    assert probed(True) < probed(False) and estimated(True) < estimated(False)
    plain, held = (fingerprint(Workload(_model, _batch, grads_held=h), SimulatedBackend("1MiB").info())
                   for h in (False, True))
    assert plain != held  # a cached probe without them never answers one with them


def test_the_command_line_takes_it_and_refuses_it_where_an_engine_keeps_its_own() -> None:
    args = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "8MiB", "--no-cache", "--json"]
    assert CliRunner().invoke(app, [*args, "--grads-held"]).exit_code == 0
    assert CliRunner().invoke(app, [*args, "--grads-held", "--strategy", "ddp", "--gpus", "2"]).exit_code == 0
    refused = CliRunner().invoke(app, [*args[:-1], "--grads-held", "--strategy", "zero3"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "--grads-held holds an unsharded step's gradients into the next forward" in refused.output


def _accumulated_peak(request: autobatch.Request, micro: int, accum: int) -> int:
    """Bytes a plain accumulation loop holds at its peak, counted apart from autobatch's tracker: the model and
    AdamW's state held, ``accum`` micro-steps whose gradients stay until the step, twice (the state made)."""
    from tests.independent_tracker import StorageCounter

    workload = autobatch.load_model(request.model).to_workload()
    model = workload.model if isinstance(workload.model, torch.nn.Module) else workload.model()
    with StorageCounter() as counter:
        counter.hold([*model.parameters(), *model.buffers()])
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            for _ in range(accum):
                workload.loss_fn(model, workload.make_batch(micro)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return counter.peak


def test_a_plan_that_accumulates_is_probed_with_the_gradients_held_and_trains_on_its_budget() -> None:
    # tiny-mlp on 4 MiB planned 677 × 2 from a probe that freed the gradients: trained so it peaks at 4.11 MiB
    budget = 4 * 1024**2
    request = autobatch.Request(model="tiny-mlp", device="cpu", memory=budget, target=1354, headroom=0)
    notes: list[str] = []
    report = autobatch.answer(request, on_note=notes.append)
    plan = report.plan
    assert report.request.grads_held and any("answered again with them held" in n for n in notes)
    # the note names the plan the first trials gave, not the final one as if it were (it said "accumulates 3"
    # where the plan printed below it accumulated 4)
    assert any("(677 per GPU × 2 accumulation)" in n for n in notes), notes
    assert plan.grad_accum > 1 and plan.micro_batch * plan.grad_accum == 1354
    assert _accumulated_peak(request, report.finding.probe.max_batch, 2) <= budget
    freed = autobatch.answer(autobatch.Request(model="tiny-mlp", device="cpu", memory=budget, headroom=0))
    assert freed.finding.probe.max_batch > report.finding.probe.max_batch
    assert _accumulated_peak(request, freed.finding.probe.max_batch, 2) > budget  # what the plan had been
    # one micro-step a step holds nothing into a next forward: answered once, as it was
    whole = autobatch.answer(autobatch.Request(model="tiny-mlp", device="cpu", memory=budget, target=600, headroom=0))
    assert whole.plan.grad_accum == 1 and not whole.request.grads_held


def test_a_cached_answer_with_the_gradients_held_is_not_said_to_be_probed_again() -> None:
    # Run twice, find's second answer came from the cache ("nothing ran now") while its note said the plan was
    # "probed again with them held" (tried as a new user would).
    request = autobatch.Request(model="tiny-mlp", device="cpu", memory=4 * 1024**2, target=1354, headroom=0,
                                cache=True)
    for run in range(2):
        notes: list[str] = []
        report = autobatch.answer(request, on_note=notes.append)
        assert report.cached == (run == 1) and report.request.grads_held, run
        assert any("answered again with them held (--grads-held)" in n for n in notes), notes
        assert not any("probed again" in n for n in notes), notes


def test_the_probe_again_with_the_gradients_held_says_no_note_twice() -> None:
    # The estimate's "no CUDA GPU here" note was printed once for each of the two estimates
    notes: list[str] = []
    report = autobatch.answer(autobatch.Request(model="tiny-gpt2", gpu="t4", target=1 << 16), on_note=notes.append)
    assert report.request.grads_held and any(n.startswith("no CUDA GPU here") for n in notes)
    assert len(notes) == len(set(notes)) and list(report.notes) == notes, notes
