"""Every recipe runs as its header says: the command under "Run …:" exits 0 and prints its sentinel.

The commands come from the recipes' own headers, so the header, recipes/README.md (checked to
list the same commands) and what this test executes cannot drift apart. Each runs in a temporary
directory (output files land there), on the CPU, one thread, bounded by a timeout.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.extras import need

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TIMEOUT_S = 120  # generous: the CPU is shared; alone each recipe takes a few seconds

# What each recipe must print (the plan's arithmetic as the library used it) and the optional
# library it needs. A new recipe fails test_every_recipe_is_listed until it is added here.
# Modules a recipe needs (each from its extra), and lines its output must contain.
EXPECTED: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "plain_loop_ga": ((), ["verify-ga: FAIL  (naive", "verify-ga: PASS  (normalised", "# 2 micro batch * 4 grad accum * 1 rank = 8 sequences per step",
                             "step   30  loss"]),
    "hf_trainer": (("transformers", "accelerate"), ["# 8 per device * 4 grad accum * 1 devices = 32 sequences per step (plan: 32)",
                                    "done: 3 optimizer steps"]),
    "accelerate_loop": (("accelerate",), ["# 128 micro batch * 4 grad accum * 1 process(es) = 512 samples per step",
                                       "done: 3 optimizer steps"]),
    "deepspeed_config": (("deepspeed",), ["7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224",
                                       # the template's 500M-element buckets, which the batch was found with
                                       "memory ≈ 1.93 GiB + ",
                                       "deepspeed accepts it on 16 ranks: 7 micro × 2 accumulation × 16 = 224, ZeRO stage 2"]),
    "lightning_autobatch": (("lightning",), ["max batch 111 (limited by memory), found in 7 trials",
                                             "# 64 batch size * 4 accumulate_grad_batches * 1 devices = 256 samples per step",
                                             "done: 3 optimizer steps"]),
    "hf_autobatch": (("transformers", "accelerate"), ["max batch 13 (limited by memory), found in 5 trials",
                                                      "# 8 per device * 4 grad accum * 1 devices = 32 sequences per step (asked: 32); eval batch 35",
                                                      "done: 2 optimizer steps"]),
    "accelerate_find": (("accelerate",), ["batch sizes the function was called with: [1024, 1, 10, 307, 448, 556, 557, 512]",
                                          "# 512 micro batch * 2 grad accum * 1 process(es) = 1024 samples per step",
                                          "done: 3 optimizer steps"]),
    "guard_loop": ((), ["split steps: [4, 14] of 20, micro-batches per batch: [4, 4]", "same weights"]),
    "lightning_fit": (("lightning",), ["# 128 batch size * 4 accumulate_grad_batches * 1 devices * 1 nodes = 512 samples per step",
                                    "done: 3 optimizer steps"]),
    "uneven_plain": ((), ["uneven plan: ", "= 100 per step", "PASS: max |Δweight|"]),
    "uneven_accelerate": (("accelerate",), ["uneven plan: ", "= 100 per step", "PASS: max |Δweight|"]),
    "uneven_lightning": (("lightning",), ["uneven plan: ", "= 100 per step", "PASS: max |Δweight|"]),
}
# A recipe runs as `python recipes/NAME.py …`, or under the launcher it shows (torchrun, accelerate launch).
RUN_HEADER = re.compile(r"^\W*Run\b[^\n]*:[ \t]*\n[#\s]*((?:python|torchrun|accelerate launch)\b[^\n]*?"
                        r"recipes/(\w+)\.py[^\n]*)", re.MULTILINE)
LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run"], "accelerate": ["-m", "accelerate.commands.launch"]}


def recipe_names() -> list[str]:
    """Every recipe; a module whose name starts with ``_`` is shared by recipes, not one."""
    return sorted(p.stem for p in RECIPES.glob("*.py") if not p.stem.startswith("_"))


def header(path: Path) -> str:
    """The opening comment block or module docstring, before the first import."""
    text = path.read_text()
    return re.split(r"^(?:from|import) ", text, maxsplit=1, flags=re.MULTILINE)[0]


def run_command(name: str) -> str:
    """The first ``python recipes/NAME.py …`` command under a "Run …:" line of the recipe's header."""
    for command, stem in RUN_HEADER.findall(header(RECIPES / f"{name}.py")):
        if stem == name:
            return command.strip()
    raise AssertionError(f"recipes/{name}.py must open with a 'Run …:' line followed by 'python recipes/{name}.py …' "
                         "(or the command under its launcher)")


def argv(name: str) -> list[str]:
    """The header's command with this interpreter: ``python`` itself, or the launcher's module."""
    args = shlex.split(run_command(name))
    head = [sys.executable] if args[0] == "python" else [sys.executable, *LAUNCHERS[args[0]]]
    args = args[1:] if args[0] in ("python", "torchrun") else args[2:]  # "accelerate launch" is two words
    return [*head, *(str(RECIPES / f"{name}.py") if a == f"recipes/{name}.py" else a for a in args)]


def test_every_recipe_is_listed() -> None:
    assert recipe_names() == sorted(EXPECTED)


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_opens_with_how_to_run_it(name: str) -> None:
    text = (RECIPES / f"{name}.py").read_text()
    assert text.startswith(('"""', "#")), f"recipes/{name}.py must open with a docstring or comment header"
    command = run_command(name)
    assert command.startswith(f"python recipes/{name}.py") or (
        command.startswith(("torchrun ", "accelerate launch ")) and f" recipes/{name}.py" in command)


def test_readme_lists_each_recipes_run_command() -> None:
    readme = (RECIPES / "README.md").read_text()
    listed = re.findall(r"`((?:python|torchrun|accelerate launch)\b[^`]*?recipes/\S+\.py[^`]*)`", readme)
    assert sorted(listed) == sorted(run_command(name) for name in recipe_names())


def test_integrations_doc_shows_the_recipes_run_commands() -> None:
    doc = (RECIPES.parent / "docs" / "integrations.md").read_text()
    shown = [line.strip() for block in re.findall(r"```bash\n(.*?)```", doc, re.S) for line in block.splitlines()
             if line.strip()]
    names = ("lightning_autobatch", "hf_autobatch", "accelerate_find", "guard_loop")
    assert shown == [run_command(name) for name in names]  # so test_recipe_runs_as_its_header_says runs them


def _run(name: str, workdir: Path) -> tuple[int, str]:
    """Run the recipe's header command in ``workdir``: its exit code and output (stdout and stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    for launched in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launched, None)
    # Own session, so that a hang kills the recipe's children too, and only them.
    proc = subprocess.Popen(argv(name), cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return -1, f"recipes/{name}.py did not finish within {TIMEOUT_S} s"
    return proc.returncode, out


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Every runnable recipe, started at once, two at a time: each runs on one thread and most of
    its time is importing its framework, so two share the CI machine's two cores."""
    import importlib.util

    runnable = [name for name in recipe_names()
                if all(importlib.util.find_spec(module.split(".")[0]) is not None for module in EXPECTED[name][0])]
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {name: pool.submit(_run, name, tmp_path_factory.mktemp(name)) for name in runnable}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_runs_as_its_header_says(name: str, recipe_runs: dict[str, Future]) -> None:
    needs, sentinels = EXPECTED[name]
    for module in needs:
        need(module)
    code, out = recipe_runs[name].result()
    assert code == 0, out
    for sentinel in sentinels:
        assert sentinel in out, f"{sentinel!r} not in the output of recipes/{name}.py:\n{out}"
    if name == "plain_loop_ga":  # and it trains: the loss of the last step well below the first's
        trained = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.split("sequences per step")[1])]
        assert len(trained) == 4 and trained[-1] < trained[0] * 0.6, trained
