"""A plan of one sample per GPU for a model with BatchNorm: said by find, estimate and check alike.

BatchNorm needs 2 samples per GPU by default (``min_micro``); ``--min-micro 1`` lets the plan go to
1, which trains where a channel holds more than one value (a conv net's pixels) but takes the
statistics of one sample. SyncBatchNorm on several ranks takes them over every rank: no word there.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import autobatch
from autobatch import check_setup
from autobatch.cli import app


def conv_net(sync: bool = False) -> torch.nn.Module:
    norm = torch.nn.SyncBatchNorm(4) if sync else torch.nn.BatchNorm2d(4)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), norm, torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, 2))


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 3, 8, 8), torch.randint(0, 2, (b,))


def notes_of(model: torch.nn.Module, gpus: int, **asked: object) -> list[str]:
    request = autobatch.Request(model=model, make_batch=make_batch, target=gpus, gpus_per_node=gpus, device="cpu",
                                memory="2MiB", **asked)
    return [n for n in autobatch.answer(request).notes if "BatchNorm" in n]


@pytest.mark.parametrize("sync, gpus, said", [(False, 4, "BatchNorm2d"), (True, 1, "SyncBatchNorm"), (True, 4, None)])
def test_a_plan_of_one_sample_per_gpu_says_what_it_does_to_batchnorm(sync, gpus, said) -> None:
    notes = notes_of(conv_net(sync), gpus, min_micro=1)
    if said is None:  # SyncBatchNorm over four ranks: four samples' statistics
        assert notes == []
    else:
        [note] = notes
        assert note.startswith(f"the plan trains 1 sample per GPU, and the model's {said} takes its statistics")
        assert "--min-micro 2" in note and "convert_sync_batchnorm" in note


def test_no_word_where_the_plan_trains_two_or_more() -> None:
    request = autobatch.Request(model=conv_net(), make_batch=make_batch, target=16, gpus_per_node=2, device="cpu",
                                memory="2MiB", min_micro=1)
    report = autobatch.answer(request)
    assert report.plan.micro_batch > 1 and not any("BatchNorm" in n for n in report.notes)


@pytest.mark.parametrize("command", [
    ["find", "--device", "cpu", "--memory", "4MiB", "--no-cache"],
    ["find", "--device", "cpu", "--memory", "4MiB", "--no-cache", "--strategy", "ddp"],
    ["estimate", "--gpu", "t4"],
])
def test_find_and_estimate_say_it_on_stderr_and_in_json(command) -> None:
    args = [*command, "--model", "tiny-cnn", "--target", "7", "--gpus", "7", "--min-micro", "1"]
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0, text.output
    assert "note: the plan trains 1 sample per GPU, and the model's BatchNorm2d" in text.stderr
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert any("BatchNorm2d takes its statistics" in n for n in data["notes"])


def test_check_takes_syncbatchnorm_on_several_gpus_as_right_and_says_why_one_sample_is_not() -> None:
    assert check_setup(target=8, micro_batch=1, grad_accum=1, gpus_per_node=8, model=conv_net(sync=True)).ok
    [problem] = check_setup(target=1, micro_batch=1, grad_accum=1, gpus_per_node=1, model=conv_net(sync=True)).problems
    assert problem.code == "batchnorm" and "SyncBatchNorm needs at least 2 samples per GPU" in problem.message
    [problem] = check_setup(target=8, micro_batch=1, grad_accum=1, gpus_per_node=8, model=conv_net()).problems
    assert "BatchNorm2d needs at least 2 samples per GPU" in problem.message
    assert "normalises each sample by itself" in problem.message and "convert_sync_batchnorm" in problem.fix


def test_a_length_table_and_a_launched_rank_say_it_too(monkeypatch) -> None:
    def at_size(b: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 3, size, size), torch.randint(0, 2, (b,))

    for estimate in (False, True):  # probed, and estimated for a card
        where = dict(gpu="t4") if estimate else dict(device="cpu", memory="2MiB")
        request = autobatch.Request(model=conv_net(), make_batch=at_size, seq_len=(6, 8), target=3, gpus_per_node=3,
                                    min_micro=1, **where)
        assert any("BatchNorm2d takes its statistics" in n for n in autobatch.answer(request).notes), estimate
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        monkeypatch.setenv(name, value)  # torchrun --nproc-per-node 1
    request = autobatch.Request(model=conv_net(), make_batch=make_batch, target=1, device="cpu", memory="2MiB",
                                min_micro=1)
    assert any("BatchNorm2d takes its statistics" in n for n in autobatch.answer(request).notes)
