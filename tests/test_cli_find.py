from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from autobatch import SimulatedBackend, probe
from autobatch.cli import app
from autobatch.configs import deepspeed_config
from autobatch.models import load_model
from tests.extras import need

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_find_gives_the_exact_max_and_a_consistent_plan():
    res = invoke("find", "--model", "tiny-gpt2", "--target", "96", "--device", "cpu", "--memory", "8MiB", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    direct = probe(load_model("tiny-gpt2").to_workload(), SimulatedBackend("8MiB"))
    assert out["max_batch"] == direct.max_batch
    assert out["safe_batch"] == direct.safe_batch
    assert out["micro_batch"] * out["grad_accum"] * out["world_size"] == out["global_batch"] == 96
    assert out["micro_batch"] <= out["safe_batch"]
    assert out["estimated"] is False
    assert {"batch", "fits", "peak_bytes"} <= set(out["trials"][0])
    fits = [t for t in out["trials"] if t["fits"]]
    fails = [t for t in out["trials"] if not t["fits"]]
    assert max(t["batch"] for t in fits) == out["max_batch"]
    assert min(t["batch"] for t in fails) == out["max_batch"] + 1


def test_find_prints_device_trials_and_plan_arithmetic():
    res = invoke("find", "--model", "tiny-mlp", "--target", "300", "--gpus", "4", "--device", "cpu", "--memory", "3MiB")
    assert res.exit_code == 0, res.output
    for text in ("device: cpu (simulated 3.00 MiB)", "trials", "max batch", "safe batch", "× 4 GPUs", "= 300"):
        assert text in res.stdout


def test_find_writes_configs_and_merges_deepspeed(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": 7}))
    acc, hf = tmp_path / "acc.yaml", tmp_path / "args.json"
    # the file trains with ZeRO-2, so the batch is found so (without --strategy it is refused, before any trial)
    res = invoke("find", "--model", "tiny-gpt2", "--target", "64", "--device", "cpu", "--memory", "8MiB",
                 "--strategy", "zero2", "--deepspeed", str(ds), "--accelerate", str(acc), "--hf", str(hf))
    assert res.exit_code == 0, res.output
    config = json.loads(ds.read_text())
    assert config["zero_optimization"]["stage"] == 2
    assert config["train_batch_size"] == 64
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] == 64
    args = json.loads(hf.read_text())
    assert args["per_device_train_batch_size"] == config["train_micro_batch_size_per_gpu"]
    assert acc.exists() and "deepspeed_config_file" in acc.read_text()  # GA lives in the DeepSpeed file


def test_own_model_from_a_file(tmp_path):
    file = tmp_path / "mymodel.py"
    file.write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5))
    """))
    res = invoke("find", "--model", f"{file}:build", "--input-shape", "3,8,8", "--num-classes", "5",
                 "--device", "cpu", "--memory", "2MiB", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["max_batch"] > 1


def test_own_make_batch_with_a_default_length_trains_at_it_unless_seq_len_says_otherwise(tmp_path):
    # make_batch(b, L=12) was refused: "takes a sequence length (b, seq_len); pass --seq-len"
    file = tmp_path / "lm.py"
    file.write_text(textwrap.dedent("""
        import torch, autobatch
        def work():
            model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
            def make_batch(b, L=12):
                return torch.randint(0, 50, (b, L))
            return autobatch.Workload(model, make_batch, loss_fn=lambda m, x: m(x).float().mean())
    """))
    found = {}
    for args in ([], ["--seq-len", "12"], ["--seq-len", "24"]):
        res = invoke("find", "--model", f"{file}:work", "--device", "cpu", "--memory", "2MiB", "--no-cache", *args,
                     "--json")
        assert res.exit_code == 0, res.output
        found[tuple(args)] = json.loads(res.stdout)["max_batch"]
    assert found[()] == found[("--seq-len", "12")] > found[("--seq-len", "24")]


def test_hf_config_directory_works_offline(tmp_path):
    transformers = need("transformers")
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=64).save_pretrained(tmp_path)
    res = invoke("find", "--model", f"hf:{tmp_path}", "--seq-len", "32", "--device", "cpu", "--memory", "4MiB", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["max_batch"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt5", "--device", "cpu", "--memory", "1GiB"], "unknown model 'gpt5'; built-in models are gpt2"),
        (["--model", "tiny-mlp", "--device", "cpu", "--memory", "lots"], "--memory must be a positive size with a unit"),
        (["--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--target", "0"], "--target must be ≥ 1, but got '0'"),
        (["--model", "missing.py:build", "--device", "cpu", "--memory", "2MiB"], "model file 'missing.py' does not exist"),
        (["--model", "tiny-mlp", "--device", "cpu"], "needs a simulated memory budget"),
        (["--model", "tiny-gpt2", "--seq-len", "4096", "--device", "cpu", "--memory", "2MiB"], "--seq-len must be between 1"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, message):
    res = invoke("find", *args)
    assert res.exit_code == 2
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output


def test_no_gpu_and_no_device_estimates_for_the_default_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = invoke("find", "--model", "tiny-gpt2", "--target", "64", "--json")
    assert res.exit_code == 0, res.output
    assert "estimates for a100-80gb" in res.stderr and "--gpu" in res.stderr
    out = json.loads(res.stdout)
    assert out["estimated"] is True and out["max_batch"] >= out["safe_batch"] > 0
    assert out["micro_batch"] * out["grad_accum"] * out["world_size"] == 64
    text = invoke("find", "--model", "tiny-gpt2", "--target", "64")  # the text report says it once, not twice
    assert text.exit_code == 0 and text.output.count("estimates for a100-80gb") == 1
    assert invoke("estimate", "--model", "tiny-gpt2").stdout.startswith("note: these are estimates for")  # alone, its own


def test_find_as_a_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "autobatch", "find", "--model", "tiny-mlp", "--target", "100", "--device", "cpu",
         "--memory", "3MiB", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["global_batch"] == 100


def test_bad_input_as_a_subprocess_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "autobatch", "find", "--model", "nope", "--device", "cpu", "--memory", "1GiB"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("Error: unknown model")


def test_models_lists_builtins_with_parameter_counts():
    res = invoke("models", "--json")
    assert res.exit_code == 0
    rows = {row["name"]: row for row in json.loads(res.stdout)}
    assert rows["gpt2"]["parameters"] == 124_439_808
    assert {"gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b", "bert-base"} <= set(rows)
    table = invoke("models")
    assert table.exit_code == 0
    # each count in its own unit: the tiny models showed as 0.0M
    assert "0.0M" not in table.stdout and "124.4M" in table.stdout and "1.2B" in table.stdout
    tiny = rows["tiny-mlp"]["parameters"]
    assert f"{tiny / 1e3:.1f}K" in table.stdout


def test_python_api_in_three_lines_leaves_the_model_unchanged():
    import autobatch

    model = torch.nn.Linear(64, 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = autobatch.find(model, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), target=96,
                          device="cpu", memory="64KiB", headroom=0)
    assert plan.micro_batch * plan.grad_accum == 96
    assert deepspeed_config(plan)["train_batch_size"] == 96
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_second_find_is_cached_and_no_cache_probes_again(trace_first):
    args = ["find", "--model", "tiny-mlp", "--target", "100", "--device", "cpu", "--memory", "3MiB", "--json"]
    first, second = json.loads(invoke(*args).stdout), json.loads(invoke(*args).stdout)
    assert not first["cached"] and second["cached"]
    assert second["max_batch"] == first["max_batch"] and second["trials"] == first["trials"]
    assert not json.loads(invoke(*args, "--no-cache").stdout)["cached"]
    text = invoke(*args[:-1]).stdout.splitlines()
    assert re.fullmatch(r"cached: probed at \d{4}-\d\d-\d\d \d\d:\d\d UTC, nothing ran now \(the fake-tensor trace "
                        r"led that search\); --no-cache probes again", text[1])  # a header, above the trials it shows
    assert second["probe"]["probed_at"] == first["probe"]["probed_at"]  # when the trials ran, kept with them


def test_find_plot_writes_a_png(tmp_path):
    need("matplotlib")
    png = tmp_path / "probe.png"
    res = invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--plot", str(png),
                 "--no-trace-prior")  # the plot is the point here, not the search
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_debug_shows_the_traceback_and_does_not_stick():
    res = invoke("--debug", "find", "--model", "nope", "--device", "cpu", "--memory", "1GiB")
    assert res.exit_code != 0 and res.exception is not None and "unknown model" in str(res.exception)
    res = invoke("find", "--model", "nope", "--device", "cpu", "--memory", "1GiB")
    assert res.exit_code == 2 and res.stderr.startswith("Error: unknown model")


def test_find_under_torchrun_runs_as_the_doc_says_every_rank_probes_and_only_rank_0_prints():
    # docs/distributed.md's command as written: one torchrun launch checks what the docs promise
    # and what launched find does (every rank probes, ranks agree, rank 0 alone prints the plan).

    out = _launched_doc_line("-m autobatch find")
    assert "torchrun: torchrun --standalone --nproc_per_node 2 train.py" in out and "launcher:" not in out
    plan = re.search(r"plan: (\d+) per GPU × (\d+) accumulation × 2 GPUs \(2 per node × 1 node\) = 64", out)
    assert plan and int(plan.group(1)) * int(plan.group(2)) * 2 == 64
    assert "on 2 rank(s)" in out
    ranks = re.findall(r"^(\d+)\s+\S+\s+cpu \(simulated", out, re.M)  # the table: one row per rank
    assert ranks == ["0", "1"]


def test_find_under_the_deepspeed_launcher_takes_its_local_rank_flag_and_names_it_in_the_plan():
    # The DeepSpeed launcher runs `python -u -m autobatch --local_rank=N find …`: typer refused the flag on
    # every rank. The docs' line as written, with the launcher itself.
    need("deepspeed")
    import re

    out = _launched_doc_line("--module autobatch find")
    assert "on 2 rank(s)" in out and re.findall(r"^(\d+)\s+\S+\s+cpu \(simulated", out, re.M) == ["0", "1"]
    assert "DeepSpeed launcher: deepspeed --num_gpus 2 train.py" in out
    # 32 samples a rank accumulate: every rank probed again with the gradients held, in the launcher's group
    # (a second rendezvous on its port hung them), and rank 0 alone says so
    assert re.search(r"plan: \d+ per GPU × \d+ accumulation", out)


def _launched_doc_line(marker: str) -> str:
    """Run docs/distributed.md's line holding ``marker`` as written; its stdout, checked as one report by rank 0."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```bash\n(.*?)```", (root / "docs" / "distributed.md").read_text(), re.S)
    line = next(l for block in blocks for l in block.splitlines() if marker in l)
    argv = line.split()
    argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert proc.stderr.count("answered again with them held") == 1, proc.stderr[-3000:]
    assert out.count("plan: ") == 1 and out.count("smallest device of the ranks: ") == 1  # rank 0 alone prints
    # the ranks' summary once, not again as one device's
    assert out.count("max batch ") == 1 and out.count("safe batch ") == 1, out
    return out
