"""spawn_local's failure paths and the lockstep agreement's, across real processes (gloo, 2 ranks each).

The jobs are module-level functions: spawned workers import this module to find them. Every
run is bounded by spawn_local's own deadline and by the assertions on elapsed time.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from autobatch import AutobatchError, NoBatchFitsError, Workload
from autobatch.distributed import probe_distributed, spawn_local
from autobatch.probing.probe import make_backend
from tests.emulated_cuda import EmulatedGpu, emulated

MIB = 1 << 20
SPAWN = dict(nprocs=2, backend="gloo", timeout_s=30)


def _rank() -> int:
    return int(os.environ["RANK"])


def job_no_batch_fits() -> str:
    if _rank() == 1:
        raise NoBatchFitsError("even a batch of 1 runs out of memory on cuda:1")
    return "done"


def job_value_error() -> str:
    if _rank() == 1:
        raise ValueError("labels must be integers")
    return "done"


def job_killed() -> str:
    if _rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "done"


def job_leaves_a_mark_at_exit(mark: str) -> str:
    atexit.register(Path(mark).write_text, f"rank {_rank()} ran the interpreter's exit handlers")
    return "done"


def job_reads_the_environment(name: str) -> tuple[str | None, int, bool]:
    return os.environ.get(name), os.getppid(), "torch.distributed.fsdp" in sys.modules


def _tiny_batch(b: int):
    return torch.randn(b, 1024), torch.randint(0, 4096, (b,))


def job_weights_do_not_fit_on_rank_1(out: str) -> None:
    """Rank 1's emulated GPU (8 MiB) cannot hold the 16 MiB of weights that rank 0's can."""
    rank, start = _rank(), time.monotonic()
    gpus = [EmulatedGpu(0, total_bytes=256 * MIB, context_bytes=0), EmulatedGpu(1, total_bytes=8 * MIB, context_bytes=0)]
    with emulated(gpus):
        try:
            probe_distributed(Workload(lambda: torch.nn.Linear(1024, 4096), _tiny_batch), make_backend("cuda"),
                              timeout_s=20)
        except Exception as exc:
            Path(out, f"rank{rank}.json").write_text(json.dumps([type(exc).__name__, str(exc), time.monotonic() - start]))
            raise


def job_rank_1_hangs_in_setup() -> None:
    def model() -> torch.nn.Module:
        if _rank() == 1:
            time.sleep(120)  # loading a model that never arrives
        return torch.nn.Linear(4, 4)

    probe_distributed(Workload(model, lambda b: (torch.randn(b, 4), torch.randint(0, 4, (b,)))), make_backend("cpu", "1MiB"),
                      timeout_s=3)


@pytest.mark.parametrize("job, message", [
    (job_no_batch_fits, r"^rank 1: even a batch of 1 runs out of memory on cuda:1$"),
    (job_value_error, r"^rank 1 failed with ValueError: labels must be integers$"),
    (job_killed, r"^rank 1 was killed by SIGKILL before it could report an error"),
])
def test_a_failing_worker_is_one_clear_error_naming_its_rank(job, message):
    expected = NoBatchFitsError if job is job_no_batch_fits else AutobatchError
    with pytest.raises(expected, match=message):
        spawn_local(job, **SPAWN)


def test_workers_skip_the_interpreters_teardown(tmp_path):
    mark = tmp_path / "teardown-ran"
    assert spawn_local(job_leaves_a_mark_at_exit, (str(mark),), **SPAWN) == "done"
    assert not mark.exists()  # they end with os._exit, as launched ranks do


def test_workers_fork_from_a_server_that_imported_torch_and_take_the_callers_environment_of_each_call(monkeypatch):
    from multiprocessing import forkserver

    modules = list(forkserver._forkserver._preload_modules)
    monkeypatch.setenv("AUTOBATCH_TEST_MARK", "first")
    value, parent, imported = spawn_local(job_reads_the_environment, ("AUTOBATCH_TEST_MARK",), **SPAWN)
    assert (value, imported) == ("first", True) and parent != os.getpid()  # not spawned by this process
    monkeypatch.setenv("AUTOBATCH_TEST_MARK", "second")  # the server started under "first" is kept
    assert spawn_local(job_reads_the_environment, ("AUTOBATCH_TEST_MARK",), **SPAWN)[0] == "second"
    monkeypatch.delenv("AUTOBATCH_TEST_MARK")
    assert spawn_local(job_reads_the_environment, ("AUTOBATCH_TEST_MARK",), **SPAWN)[0] is None
    assert forkserver._forkserver._preload_modules == modules  # the caller's setting, as it was


def test_weights_that_do_not_fit_on_one_rank_stop_every_rank_with_the_same_error(tmp_path):
    with pytest.raises(NoBatchFitsError, match=r"^rank 1: the model's weights alone do not fit on NVIDIA Emulated GPU"):
        spawn_local(job_weights_do_not_fit_on_rank_1, (str(tmp_path),), **SPAWN)
    ends = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ends[0][:2] == ends[1][:2]
    assert ends[0][0] == "NoBatchFitsError" and "CUDA out of memory" in ends[0][1]
    assert max(seconds for _, _, seconds in ends) < 20  # agreed at once, not after a timeout


def test_a_rank_that_hangs_ends_the_agreement_with_one_clear_error_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(AutobatchError, match=r"rank 0: lost contact with the other ranks while setting up "
                                             r"\(no answer within 3 s"):
        spawn_local(job_rank_1_hangs_in_setup, **SPAWN)  # the process group itself would wait 90 s
    assert time.monotonic() - start < 45


def test_where_there_is_no_fork_server_the_workers_are_spawned(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # as on Windows
    monkeypatch.setenv("AUTOBATCH_TEST_MARK", "spawned")
    value, parent, _ = spawn_local(job_reads_the_environment, ("AUTOBATCH_TEST_MARK",), **SPAWN)
    assert value == "spawned" and parent == os.getpid()


UNGUARDED_SCRIPT = """
from autobatch.distributed import spawn_local

def job():
    return 1

print(spawn_local(job, nprocs=2, backend="gloo", timeout_s=30))
"""


def test_a_script_calling_spawn_local_unguarded_is_told_to_guard_the_call(tmp_path):
    # Each worker runs the calling script again as it starts (multiprocessing's bootstrapping): the
    # call at its top level is refused there with the fix, and the caller's line points to it (it
    # guessed the host's memory before)
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run.returncode != 0
    assert ("AutobatchError: spawn_local was called in a worker process as it started: each worker runs the calling "
            "script again on start, so a call at the script's top level runs in every worker too; put the call under "
            '`if __name__ == "__main__":`') in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.endswith("exited with code 1 before it could report an error (the traceback above says why); every "
                         "other worker was stopped") and "out of host memory" not in run.stderr, run.stderr[-2000:]
