"""autobatch's drop-in for accelerate's ``find_executable_batch_size``, in accelerate's own test pattern.

accelerate tests its decorator with a function that raises a fake out-of-memory error above some
batch and asserts the exact sequence of batch sizes tried; so do these, side by side with
accelerate's decorator on the same function (its sequence is the ×0.9 walk).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch

from autobatch import SimulatedBackend
from autobatch.errors import AutobatchError

from tests.extras import need
from tests.ranks import gathered, slow
accelerate = need("accelerate")
from accelerate.utils import find_executable_batch_size as accelerate_find

from autobatch.integrations.accelerate import find_executable_batch_size

LIMIT = 37  # the largest batch the fake device holds


def raise_fake_out_of_memory() -> None:
    raise RuntimeError("CUDA out of memory.")  # accelerate's test helper raises exactly this


def training_function(batch_size: int, log: list[int] | None = None) -> int:
    """Three optimizer steps of a tiny model; out of memory above LIMIT, in the first forward."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        if batch_size > LIMIT:
            raise_fake_out_of_memory()
        model(torch.randn(batch_size, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if log is not None:
        log.append(batch_size)
    return batch_size


def test_finds_the_exact_max_where_accelerate_walks_down_by_ten_percent(monkeypatch) -> None:
    # accelerate collects garbage before every call (a second each in a process this size); no cache on the CPU.
    monkeypatch.setattr("accelerate.utils.memory.clear_device_cache", lambda garbage_collection=False: None)
    tried: list[int] = []

    @accelerate_find(starting_batch_size=128)
    def theirs(batch_size: int) -> int:
        tried.append(batch_size)
        return training_function(batch_size)

    assert theirs() == 36  # 10 % steps jump over 37
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36]

    completed: list[int] = []
    ours = find_executable_batch_size(starting_batch_size=128)(training_function)
    assert ours(completed) == LIMIT
    # 128 fails; 2-step trials (no memory figures on the CPU: pass/fail only) bisect below the 128
    # known to fail instead of doubling up to it, find 37 exactly in 9 (12 before), then one full run at 37.
    assert ours.batch_sizes == [128, 1, 11, 37, 82, 59, 48, 42, 39, 38, 37]
    assert completed == [37]  # trials stop after their 2nd optimizer step: only the real run completed
    fits = {t.batch: t.fits for t in ours.trials}
    assert fits[LIMIT] and not fits[LIMIT + 1]  # exact: the trials prove it


def test_a_starting_batch_that_fits_runs_once_like_accelerate() -> None:
    ours = find_executable_batch_size(starting_batch_size=16)(training_function)
    assert ours() == 16
    assert ours.batch_sizes == [16]


def mlp_training(batch_size: int, backend: SimulatedBackend | None = None) -> int:
    """Three AdamW steps of an MLP; under ``backend``'s budget when given (accelerate's decorator knows none)."""
    with backend.track([]) if backend is not None else nullcontext():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            x, y = torch.randn(batch_size, 64), torch.randint(0, 10, (batch_size,))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return batch_size


def test_with_memory_figures_the_search_takes_a_few_trials(monkeypatch) -> None:
    monkeypatch.setattr("accelerate.utils.memory.clear_device_cache", lambda garbage_collection=False: None)
    backend = SimulatedBackend("2MiB")
    tried: list[int] = []

    @accelerate_find(starting_batch_size=4096)
    def theirs(batch_size: int) -> int:
        tried.append(batch_size)
        return mlp_training(batch_size, backend)

    assert theirs() == 549 and len(tried) == 20  # 19 runs out of memory, then 7 under the max

    train = find_executable_batch_size(starting_batch_size=4096, backend=backend)(mlp_training)
    best = train()
    fits = {t.batch: t.fits for t in train.trials}
    assert best == 556 and fits[best] and not fits[best + 1]  # exact: the next batch ran out of memory
    # 4096 fails; 6 two-step trials with per-phase peaks find 556; then the real run at 556.
    assert train.batch_sizes == [4096, 1, 10, 307, 448, 556, 557, 556]


def test_target_sets_the_accelerators_gradient_accumulation() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)

    @find_executable_batch_size(starting_batch_size=128, target=120, accelerator=accelerator)
    def train(batch_size: int) -> int:
        return training_function(batch_size)

    # 37 fits; the largest micro batch ≤ 37 that divides 120 is 30: 30 × 4 accumulation × 1 process.
    assert train() == 30
    assert accelerator.gradient_accumulation_steps == 4
    assert str(train.plan).endswith("= 120")


def test_other_errors_pass_through_and_the_batch_size_is_not_passed_twice() -> None:
    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size: int) -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()
    with pytest.raises(TypeError, match="Batch size was passed into `training_function`"):
        find_executable_batch_size(training_function, starting_batch_size=8)(8, None)
    with pytest.raises(AutobatchError, match="starting_batch_size must be a positive integer"):
        find_executable_batch_size(training_function, starting_batch_size=1.5)  # not a number of samples: at once


def test_guard_keeps_the_decorated_run_alive_through_a_rare_long_batch() -> None:
    """One batch in ten is 4× longer; with the guard the run at the starting batch completes (no restart) and
    trains, through accelerator.backward and 2-step accumulation, to the weights of a budget that fits them all."""
    from accelerate import Accelerator

    from autobatch.integrations.accelerate import guard
    from tests.test_guard import LM, data, loss_fn

    def run(budget: str | None, guarded: bool):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)

        @find_executable_batch_size(starting_batch_size=8, backend=SimulatedBackend(budget) if budget else None)
        def train(batch_size: int):
            torch.manual_seed(0)
            model = LM()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, optimizer = accelerator.prepare(model, optimizer)
            step = guard(accelerator, model, loss_fn, shift=True)
            for batch in data(4):  # the 4th is the long one, the 2nd of its accumulation window
                assert len(batch["input_ids"]) == batch_size
                with accelerator.accumulate(model):
                    if guarded:
                        step.backward(batch)
                    else:
                        losses, mask = loss_fn(model, batch)
                        accelerator.backward(losses[mask].sum() / mask.sum())
                    optimizer.step()
                    optimizer.zero_grad()
            return accelerator.unwrap_model(model), step

        return train(), train.batch_sizes

    (reference, _), _ = run(None, guarded=False)  # no budget: every batch fits
    (model, step), called = run("600KiB", guarded=True)
    assert called == [8]  # the first run went through: nothing restarted it smaller
    assert [(s.step, s.pieces, s.attempts) for s in step.history] == [(4, 4, 3)] and step.steps == 4
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert ((a - b).norm() / a.norm()).item() <= 1e-5, name


OTHER_LIMIT = 29  # the largest batch the other rank's (smaller) device holds


def test_ranks_combine_their_trials_and_end_on_the_smaller_device(monkeypatch) -> None:
    """Rank 0 of 2, with rank 1's answers supplied where the all-gather would bring them (the gloo exchange itself
    is tests/test_integration_accelerate.py::test_two_gloo_ranks_with_different_budgets_end_on_the_same_batch)."""
    import autobatch.integrations.accelerate as integration

    gathered: list[int] = []

    def share(comm, trial):  # what share_trial returns on rank 0: [rank 0's trial, rank 1's]
        gathered.append(trial.batch)
        other = dataclasses.replace(trial, fits=trial.batch <= OTHER_LIMIT,
                                    error=None if trial.batch <= OTHER_LIMIT else "CUDA out of memory.")
        return [trial, other]

    monkeypatch.setattr(integration, "world", lambda: (0, 2))
    monkeypatch.setattr(integration, "comm_device", lambda backend=None: torch.device("cpu"))
    monkeypatch.setattr(integration, "share_trial", share)
    completed: list[int] = []
    train = find_executable_batch_size(starting_batch_size=128)(training_function)
    assert train(completed) == OTHER_LIMIT and completed == [OTHER_LIMIT]
    # 128 is an agreed trial first (in a group no rank runs the whole function alone), then the search below it
    # follows the agreed outcomes (37 fits here, not on rank 1) to 29, then the one real run.
    assert train.batch_sizes == [128, 1, 11, 37, 24, 30, 27, 28, 29, 29]
    assert gathered == train.batch_sizes[:-1]  # every trial was shared, the real run was not
    assert [t.fits for t in train.trials] == [False, True, True, False, True, False, True, True, True]
    assert train.trials[3].error == "out of memory on rank 1"


def _two_rank_find(budgets: tuple[str, str]) -> list:
    """One rank of two (inside spawn_local's gloo group), each with its own simulated budget."""
    import torch.distributed as dist

    rank = dist.get_rank()
    train = find_executable_batch_size(starting_batch_size=4096, backend=SimulatedBackend(budgets[rank]))(mlp_training)
    mine = (train(), train.batch_sizes, [(t.batch, t.fits) for t in train.trials])
    return gathered(mine)


@slow("two-process gloo run")
def test_two_gloo_ranks_with_different_budgets_end_on_the_same_batch() -> None:
    from autobatch.distributed import spawn_local

    alone = find_executable_batch_size(starting_batch_size=4096, backend=SimulatedBackend("1MiB"))(mlp_training)
    smaller = alone()  # what the 1 MiB device holds on its own
    ranks = spawn_local(_two_rank_find, (("2MiB", "1MiB"),), nprocs=2, backend="gloo", timeout_s=120)
    assert ranks[0] == ranks[1]  # the same answer, batch sizes and agreed trials on both ranks
    best, called, trials = ranks[0]
    assert best == smaller < 556  # the 1 MiB rank limits both (556 is the 2 MiB device's own answer)
    assert (best, True) in trials and (best + 1, False) in trials and called[-1] == best


def test_an_optimizer_and_scheduler_passed_in_come_back_as_they_were_after_the_trials() -> None:
    # the trials' steps stayed in an optimizer passed in: the real run started from Adam moments and a
    # step count of 10 trial steps at other batch sizes, and ended on other weights than a clean run's
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def body(batch_size, model, optimizer, scheduler):
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()

    model, optimizer, scheduler = build()
    train = find_executable_batch_size(body, starting_batch_size=4096, backend=SimulatedBackend("2MiB"))
    train(model, optimizer, scheduler)
    found = train.batch_sizes[-1]
    assert len(train.batch_sizes) > 3  # trials ran, each taking optimizer steps
    assert [float(s["step"]) for s in optimizer.state_dict()["state"].values()] == [3.0] * 4
    assert scheduler.last_epoch == 3
    clean_model, clean_optimizer, clean_scheduler = build()
    body(found, clean_model, clean_optimizer, clean_scheduler)
    for a, b in zip(model.parameters(), clean_model.parameters()):
        assert torch.equal(a, b)
