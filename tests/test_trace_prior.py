"""``find`` led by the fake-tensor trace: fewer trials, the same exact answer, nothing of the caller's touched.

A simulated budget stands in for the device; every count below is an exact trial sequence.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from typer.testing import CliRunner

import autobatch
from autobatch import SimulatedBackend, Workload
from autobatch.cli import app
from autobatch.estimating.estimate import estimate
from autobatch.estimating.prior import GuardedPrior, trace_prior, try_trace_prior
from autobatch.pipeline import TURNED_OFF, find_plan
from autobatch.probing.search import NoTrace, search_max
from autobatch.probing.trial import Trial
from tests.tiny import cnn_workload, lm_workload, mlp, mlp_workload


def batches(finding):
    return [(t.batch, t.fits) for t in finding.probe.trials]


def exact(finding) -> bool:
    tried = {t.batch: t.fits for t in finding.probe.trials}
    best = finding.probe.max_batch
    return tried.get(best) is True and tried.get(best + 1) is False


def test_find_with_the_trace_takes_fewer_trials_and_gives_the_same_answer(trace_first):
    with_prior = find_plan(cnn_workload(), backend=SimulatedBackend("1MiB"), headroom=0)
    without = find_plan(cnn_workload(), backend=SimulatedBackend("1MiB"), headroom=0, use_trace_prior=False)
    # BatchNorm: the search starts at 2, and so does the trace.
    assert batches(with_prior) == [(2, True), (28, True), (29, False)]
    assert batches(without) == [(2, True), (17, True), (28, True), (29, False)]
    assert with_prior.probe.max_batch == without.probe.max_batch == 28 and exact(with_prior) and exact(without)
    assert with_prior.plan == without.plan
    # The result says the trace led it, where it traced and what that cost; without one, nothing.
    said = with_prior.probe.extra["trace_prior"]
    assert said["traced_batches"] == [2, 4, 16, 64] and said["failure"] is None and said["seconds"] > 0
    assert "led by the fake-tensor trace (traced at batches 2, 4, 16, 64 in " in str(with_prior.probe)
    assert with_prior.probe.trace_led and not without.probe.trace_led
    # without it, the record says so and why, never by its absence
    assert without.probe.extra["trace_prior"]["led"] is False
    assert without.probe.extra["trace_prior"]["reason"] == TURNED_OFF
    assert f"the trials alone searched: {TURNED_OFF}" in str(without.probe)


def test_the_trace_leaves_the_model_the_rng_and_the_default_dtype_as_they_were():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    model.eval()
    finding = find_plan(Workload(model, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), dtype="bf16"),
                        backend=SimulatedBackend("128KiB"), headroom=0)
    assert exact(finding)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_default_dtype() == torch.float32 and not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None and type(p) is torch.nn.Parameter for p in model.parameters())


class _DataDependent(torch.nn.Module):
    """A tensor whose size its input's values set, with no bound in its input's shape (``bincount``:
    the largest value plus one): fake tensors have no values, so the trace cannot follow it (a value
    read as a number, ``.item()``, reads a stand-in; ``nonzero``, boolean masks and ``unique`` take
    their largest size: tests/test_data_dependent.py)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.net(x) * (1 + 0 * torch.bincount((x > 0).long().flatten()).shape[0])


def test_a_model_the_trace_cannot_follow_is_searched_from_its_trials_alone(caplog, trace_first):
    work = Workload(_DataDependent(), lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))))
    with caplog.at_level(logging.DEBUG, logger="autobatch.estimating.prior"):
        led = find_plan(work, backend=SimulatedBackend("256KiB"), headroom=0)
    alone = find_plan(work, backend=SimulatedBackend("256KiB"), headroom=0, use_trace_prior=False)
    assert batches(led) == batches(alone) and exact(led)
    assert len(caplog.records) == 1 and "trials alone" in caplog.records[0].getMessage()
    failure = led.probe.extra["trace_prior"]["failure"]  # and the report says so, with the trace's error
    assert failure.split(":")[0] in caplog.records[0].getMessage()
    assert f"the trace stopped ({failure}; " in str(led.probe) and "the trials searched on alone" in str(led.probe)
    assert not led.probe.trace_led  # one rule for every report: a trace that stopped did not lead


def test_a_factory_that_cannot_be_built_on_fake_tensors_gives_a_prior_that_says_why():
    import math

    def build():
        model = mlp()
        model.load_state_dict({})  # raises (no weights to load), as a loader that needs real files would
        return model

    work = Workload(build, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))))
    prior = try_trace_prior(work)
    assert math.isnan(prior(4)) and prior.report()["failure"].startswith("RuntimeError: Error(s) in loading")
    # and a probe it was handed says, in one line, that the trace could not lead and why
    result = autobatch.probe(Workload(mlp(), work.make_batch), SimulatedBackend("4MiB"), prior=prior, max_batch=8)
    assert not result.trace_led and result.extra["trace_prior"]["traced_batches"] == []
    assert "the trace stopped (RuntimeError: Error(s) in loading" in str(result)


def test_a_batchnorm_model_is_traced_from_its_smallest_batch():
    prior = trace_prior(cnn_workload())  # a trace at batch 1 would raise BatchNorm's error
    assert 0 < prior(1) == prior(2) < prior(3) < prior(4)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # torch's own fast-path check
def test_a_factory_whose_modules_copy_their_layers_is_traced():
    # nn.TransformerEncoder deep-copies its layer; built on fake tensors, the copies had fake
    # modes of their own and the trace (and estimate) failed with "Mixing fake modes".
    def build():
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                   torch.nn.Flatten(), torch.nn.Linear(16 * 8, 4))

    prior = trace_prior(Workload(build, lambda b: (torch.randn(b, 8, 16), torch.randint(0, 4, (b,)))))
    assert 0 < prior(1) < prior(16)


def test_every_search_the_trace_did_not_lead_says_why():
    def why(result):
        said = result.to_dict()["trace_prior"]
        assert said["led"] is False and result.trace_line() == f"the trials alone searched: {said['reason']}"
        return said["reason"]

    curve = lambda b: 100_000 + 4_000 * b
    assert why(autobatch.probe(mlp_workload(), SimulatedBackend("4MiB"), prior=curve)) == \
        "a prior of the caller's own led the search, not the trace"
    unasked = try_trace_prior(mlp_workload())
    result = autobatch.probe(mlp_workload(), SimulatedBackend("4MiB"), min_batch=3, max_batch=3, prior=unasked)
    assert [t.batch for t in result.trials] == [3]  # a bracket of one
    assert why(result) == "the search ended before it asked the trace"
    assert why(autobatch.probe(mlp_workload(), SimulatedBackend("4MiB"))) == "no prior was given to the search"
    assert why(autobatch.probe(mlp_workload(), SimulatedBackend("4MiB"), prior=NoTrace("mine"))) == "mine"


def test_the_search_drops_a_prior_that_answers_nan_and_stays_exact():
    run = lambda b: Trial(b, 100 + 7 * b <= 1000, 100 + 7 * b, 100 + 7 * b, resident_bytes=100)
    failing = lambda b: 100 + 7 * b if b < 4 else math.nan
    assert [t.batch for t in search_max(run, 1000, prior=failing).trials] == \
        [t.batch for t in search_max(run, 1000).trials] == [1, 25, 128, 129]


def test_cli_no_trace_prior_searches_from_trials_alone(tmp_path, trace_first):
    (tmp_path / "net.py").write_text("import torch\ndef build():\n    return torch.nn.Sequential("
                                     "torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), "
                                     "torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 10))\n")
    args = ["find", "--model", f"{tmp_path / 'net.py'}:build", "--input-shape", "3,16,16", "--device", "cpu",
            "--memory", "2MiB", "--headroom", "0", "--no-cache", "--json"]
    led = json.loads(CliRunner().invoke(app, args).stdout)
    alone = json.loads(CliRunner().invoke(app, [*args, "--no-trace-prior"]).stdout)
    assert [t["batch"] for t in led["trials"]] == [2, 49, 50]
    assert [t["batch"] for t in alone["trials"]] == [2, 17, 49, 50]
    assert led["max_batch"] == alone["max_batch"] == 49
    assert led["probe"]["trace_prior"]["traced_batches"] == [2, 4, 16, 64] and led["probe"]["trace_prior"]["led"]
    assert alone["probe"]["trace_prior"]["led"] is False and alone["probe"]["trace_prior"]["reason"] == TURNED_OFF


def test_a_cached_answer_says_how_its_search_went_and_how_to_search_again(tmp_path, monkeypatch, trace_first):
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    args = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--target", "64"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0 and "led by the fake-tensor trace" in first.stdout and "cached" not in first.stdout
    again = CliRunner().invoke(app, [*args, "--no-trace-prior"])
    assert again.exit_code == 0 and "led by the fake-tensor trace" in again.stdout
    assert (", nothing ran now (the fake-tensor trace led that search); "
            "--no-cache probes again without the trace") in again.stdout and "cached: probed at " in again.stdout
    fresh = CliRunner().invoke(app, [*args, "--no-trace-prior", "--no-cache"])
    assert "fake-tensor trace" not in fresh.stdout and "cached" not in fresh.stdout
    # that trials-only answer, now the cached one, says so to a find that would have traced
    plain = CliRunner().invoke(app, args)
    assert ", nothing ran now (its trials alone searched); --no-cache probes again\n" in plain.stdout


def test_find_takes_the_switch(trace_first):
    # AdamW's step sets a linear layer's peak at small batches (a flat start): trials alone
    # climb in bounded steps until the activations take over; the trace knows where they do.
    make = lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,)))
    tried: dict[bool, list[int]] = {True: [], False: []}
    plans = {flag: autobatch.find(torch.nn.Linear(64, 10), make, device="cpu", memory="128KiB", headroom=0,
                                  use_trace_prior=flag, on_trial=lambda t, flag=flag: tried[flag].append(t.batch))
             for flag in (True, False)}
    assert tried[True] == [1, 320, 321]
    assert tried[False] == [1, 27, 262, 310, 320, 321]
    assert plans[True] == plans[False] and plans[True].micro_batch == 320


def _hf_dir(tmp_path, name, config):
    config.save_pretrained(tmp_path / name)
    return f"hf:{tmp_path / name}"


def test_a_trace_torch_cannot_run_is_one_line_in_the_report_and_nothing_on_stderr(tmp_path, trace_first):
    from typer.testing import CliRunner

    from autobatch.cli import app

    from .extras import need

    transformers = need("transformers")
    # Mixtral's experts run torch's grouped matmul, which refuses fp32 fake tensors.
    model = _hf_dir(tmp_path, "mixtral", transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128))
    result = CliRunner().invoke(app, ["find", "--model", model, "--device", "cpu", "--memory", "64MiB", "--seq-len", "32",
                                      "--max-micro", "8", "--no-cache"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stdout.splitlines() if line.startswith("the trace stopped (")]
    assert len(said) == 1 and said[0].endswith("the trials searched on alone"), result.stdout
    assert "failed while attempting to run meta" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["t5", "vit"])
def test_an_hf_model_with_a_head_autobatch_does_not_build_is_one_line(tmp_path, name):
    from typer.testing import CliRunner

    from autobatch.cli import app

    from .extras import need

    transformers = need("transformers")
    config = (transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=128)
              if name == "t5" else transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                          num_attention_heads=2, image_size=32, patch_size=8))
    result = CliRunner().invoke(app, ["find", "--model", _hf_dir(tmp_path, name, config), "--device", "cpu",
                                      "--memory", "64MiB"])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    said = " ".join(result.stderr.split())
    assert f"or with the head their config's architectures name (sequence or token classification, image " \
           f"classification, seq2seq), but '{name}' names none (no architectures)" in said


@pytest.mark.parametrize("allocator", ["exact", "caching"])
@pytest.mark.parametrize("make", [mlp_workload, lm_workload, cnn_workload], ids=["mlp", "lm", "cnn"])
def test_the_prior_read_off_one_symbolic_trace_is_the_prior_traced_batch_by_batch(make, allocator, monkeypatch):
    from autobatch.estimating import prior as priors

    once = trace_prior(make(), allocator=allocator, device_type="cpu")
    asked = [1, 2, 3, 4, 7, 16, 17, 40, 64, 65, 300]
    read = [once(b) for b in asked]
    monkeypatch.setattr(priors, "trace_batches", lambda *args, **kwargs: None)
    per_batch = trace_prior(make(), allocator=allocator, device_type="cpu")
    assert read == [per_batch(b) for b in asked]
    assert sorted(per_batch.traced) == [2, 4, 16, 64] and not per_batch.once
    # the conv net's CPU convolution takes another path from batch 16 on: its curve does not answer
    # every batch the per-batch prior traces, so that prior leads, and the curve traced nothing alone
    general = make is not cnn_workload
    assert once.once is general and sorted(once.traced) == ([] if general else [2, 4, 16, 64])


def test_a_trace_torch_pins_to_one_batch_stops_there_and_the_batches_are_traced_each_at_its_size():
    from autobatch.estimating.estimate import _new_fake_mode, trace_batches, training_copy

    class Contrastive(torch.nn.Module):  # labels from len(): a plain int, which pins the batch (CLIP's loss)
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)

        def forward(self, x):
            logits = self.a(x) @ self.b(x).T
            return torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))

    work = Workload(Contrastive(), lambda b: torch.randn(b, 16), loss_fn=lambda m, x: m(x), name="contrastive")
    mode = _new_fake_mode()
    why: list[str] = []
    assert trace_batches(work, training_copy(work, mode), fake_mode=mode, cuda_autocast=False, why=why.append) is None
    # why, and where: the line of the model that read len() (not the unwinding's zero_grad, as it once said)
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "torch.arange(len(logits))" in text)
    assert why == [f"torch pinned the batch to 8 at {__file__}:{line} in forward, where len() or int() read a "
                   "batch-sized dimension"], why
    prior = trace_prior(work, device_type="cpu")
    assert prior(100) > prior(10) > 0 and not prior.once and sorted(prior.traced) == [2, 4, 16, 64]
    # the peak at batch b: the logits (b × b floats) and their softmax and gradient grow with its square
    assert prior(200) - 2 * prior(100) + prior(1) > 0
    # said in the search's record of the trace (find's --json trace_prior and its line) and in an estimate's report
    guarded = GuardedPrior(trace_prior(work, device_type="cpu"), "contrastive")
    guarded(16)
    said = guarded.report()
    assert said["not_traced_once"] == why[0]
    probed = autobatch.probe(mlp_workload(), SimulatedBackend("2MiB"))
    line = type(probed)(**{**probed.__dict__, "extra": {"trace_prior": said}}).trace_line()
    assert line.endswith(f"; its one trace for every batch stopped: {why[0]}"), line
    result = estimate(work, gpu_memory="700MiB")
    assert result.extra["not_traced_once"] == why[0] and result.extra["traced_once_for"] == []
    assert f"since the one trace with the batch a symbol stopped: {why[0]}" in str(result)
