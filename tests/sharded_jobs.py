"""Models and per-rank jobs shared by the sharded-training tests (module level, so spawned ranks can run them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import autobatch
from autobatch.distributed.sharded_trial import run_sharded_trial
from autobatch.probing.backends import SimulatedBackend
from autobatch.probing.memtrack import MemoryTracker
from autobatch.strategy import Strategy, parse_strategy
from tests.ranks import gathered

WIDTH, DEPTH, TOKENS = 64, 4, 16


class Block(torch.nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def blocks() -> torch.nn.Module:
    """Four blocks of 64×64: 16,640 parameters (66,560 bytes in fp32), activations 4 KiB per sample and block."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(DEPTH)])


def batch(b: int) -> torch.Tensor:
    return torch.randn(b, TOKENS, WIDTH)


def workload(model: Any = blocks, dtype: str | None = None) -> autobatch.Workload:
    return autobatch.Workload(model, batch, dtype=dtype)


def fake_and_real(strategy: str, budget: int, dtype: str | None = None) -> tuple[Any, Any]:
    """``probe_sharded`` of the blocks as rank 0 of 4 on fake tensors and with real steps on the same budget;
    checks that both took the same trials, byte for byte, with the same per-rank terms, and returns both."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autobatch.distributed.simulated_world import probe_sharded
    from autobatch.estimating.fake_backends import fake_backend

    with FakeTensorMode():
        fake_model = blocks()
    backend = fake_backend(fake_model, budget, fused_attention=False)
    assert backend is not None
    fake = probe_sharded(workload(fake_model, dtype), backend, strategy, 4)
    real = probe_sharded(workload(dtype=dtype), SimulatedBackend(budget), strategy, 4)
    assert [(t.batch, t.fits, t.peak_bytes) for t in fake.trials] == [(t.batch, t.fits, t.peak_bytes) for t in real.trials]
    assert fake.extra["sharding"]["per_rank"] == real.extra["sharding"]["per_rank"]
    return fake, real


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def fsdp2_step_figures() -> dict[str, int]:
    """One FSDP2 rank: two AdamW steps counted by the tracker and by the CPU allocator (profiler)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = blocks()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker()
    tracker.add(model.parameters())
    base = tracker.current_bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with tracker:
            for _ in range(2):
                model(batch(4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        _settle(tracker)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = allocator_peak = 0
    for event in events:
        live += event.nbytes()
        allocator_peak = max(allocator_peak, live)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    expected = sum(local(t).untyped_storage().nbytes() for t in [*model.parameters(), *state])
    return {"rank": dist.get_rank(), "base": base, "tracker_peak": tracker.peak_bytes - base,
            "allocator_peak": allocator_peak, "tracker_resident": tracker.current_bytes,
            "allocator_resident": base + live, "expected_resident": expected}


def _settle(tracker: MemoryTracker) -> None:
    """Wait until gloo's worker threads have let go of the last collectives' buffers.

    A finished collective's tensors stay referenced by its work until the worker thread that ran
    it drops the work, a moment after it completes; the resident figure read in that moment holds
    one more gathered block (16,640 bytes), and a worker may hold its last work until it takes the
    next. A few small collectives pass through every worker (gloo runs two), the barrier finishes
    them all, and the figure is read once it has stayed the same for a tenth of a second.
    """
    import time

    for _ in range(4):
        dist.all_reduce(torch.zeros(1))
    dist.barrier()
    last, steady_since = tracker.current_bytes, time.monotonic()
    deadline = steady_since + 5
    while time.monotonic() - steady_since < 0.1 and time.monotonic() < deadline:
        time.sleep(0.01)
        if tracker.current_bytes != last:
            last, steady_since = tracker.current_bytes, time.monotonic()


def trial_peaks(strategies: tuple[str, ...] = ("fsdp2", "zero2"), batch_size: int = 3) -> dict[str, Any]:
    """This rank's sharded trial figures per strategy, on a budget none of them reaches."""
    backend = SimulatedBackend("1GiB")
    out: dict[str, Any] = {"rank": dist.get_rank()}
    for name in strategies:
        done = run_sharded_trial(workload(), blocks(), parse_strategy(name), backend, batch_size)
        t = done.trial
        out[name] = (t.peak_bytes, t.forward_backward_bytes, t.optimizer_bytes, t.resident_bytes,
                     done.breakdown.to_dict() if done.breakdown else None)
    return out


def gloo_job() -> list[dict[str, Any]]:
    """Every rank's figures, gathered (spawn_local returns rank 0's answer)."""
    mine = {"fsdp2_step": fsdp2_step_figures(), "trials": trial_peaks()}
    return gathered(mine)


def launched_probe(strategy: str = "fsdp2") -> dict[str, Any]:
    """Every rank probes ``strategy`` on its own simulated budget, in lockstep (rank 1 has less memory)."""
    from autobatch.distributed.lockstep import probe_distributed

    budget = ["900KiB", "700KiB"][dist.get_rank() % 2]
    result = probe_distributed(workload(), SimulatedBackend(budget), strategy=strategy)
    agreed = result.to_probe_result()
    return {"rank": dist.get_rank(), "max_batch": result.max_batch, "limiting": result.limiting_ranks,
            "trials": [(t.batch, t.fits) for t in result.trials], "wrapped": result.wrapped,
            "sharding": agreed.extra["sharding"],
            "own": [[(t.batch, t.fits) for t in r.trials] for r in result.ranks]}


def launched_job() -> list[dict[str, Any]]:
    mine = launched_probe()
    return gathered(mine)


def wide_blocks() -> torch.nn.Module:
    """Six 512-wide blocks: 1.6M parameters, so a caching-allocator budget of tens of MiB is reached."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(6)])


def wide_batch(b: int) -> torch.Tensor:
    return torch.randn(b, 64, 512)


def out_of_memory_on_one_rank(strategies: tuple[str, ...], budgets: tuple[str, ...], timeout_s: float) -> list[Any]:
    """Each strategy probed in lockstep, rank r on the r-th budget, with the caching-allocator model: it
    raises out of memory mid-step, where it happens, as a GPU does (the exact model defers to the step's end)."""
    from autobatch.distributed.lockstep import probe_distributed

    out = {}
    for name in strategies:
        result = probe_distributed(autobatch.Workload(wide_blocks, wide_batch),
                                   SimulatedBackend(budgets[dist.get_rank()], allocator="caching"),
                                   strategy=name, timeout_s=timeout_s)
        mine = result.ranks[dist.get_rank()].trials
        out[name] = {"max_batch": result.max_batch, "limiting": result.limiting_ranks,
                     "agreed": [(t.batch, t.fits) for t in result.trials],
                     "mine": [(t.batch, t.fits, t.error) for t in mine]}
    return gathered(out)


def ddp_buckets_do_not_fit_on_rank_1() -> list[Any]:
    """Rank 1 holds the weights (16 MiB) but not DDP's gradient buckets beside them; rank 0 holds both."""
    from autobatch.distributed.lockstep import probe_distributed

    budget = ("200MiB", "24MiB")[dist.get_rank()]
    try:
        probe_distributed(autobatch.Workload(lambda: torch.nn.Linear(1024, 4096), lambda b: torch.randn(b, 1024)),
                          SimulatedBackend(budget), wrap="ddp", timeout_s=8)
    except Exception as exc:  # noqa: BLE001 - what each rank was told is the answer
        return gathered((type(exc).__name__, str(exc)))
    return gathered(None)


def offload_under_a_launcher_on_the_cpu() -> list[Any]:
    """Every rank told why an offloading strategy cannot be probed on the CPU, before any trial."""
    from autobatch.distributed.lockstep import probe_distributed

    told = []
    for strategy in (Strategy("fsdp2", offload="params"), Strategy("zero2", offload="optimizer")):
        try:
            probe_distributed(workload(), SimulatedBackend("64MiB"), strategy=strategy, timeout_s=20)
            told.append(None)
        except Exception as exc:  # noqa: BLE001 - what each rank was told is the answer
            told.append((type(exc).__name__, str(exc)))
    return gathered(told)


LONG_TOKENS = 256  # activations of 64 KiB per sample and block: far above what collectives in flight hold


def long_batch(b: int) -> torch.Tensor:
    return torch.randn(b, LONG_TOKENS, WIDTH)


def _wrap_as_users_do(model: torch.nn.Module, strategy: str, batch: int, zero: dict[str, Any] | None) -> Any:
    """The model wrapped with the libraries' own calls (not autobatch's): (module, backward, step)."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model)
    elif strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        module = fully_shard(model, mesh=mesh)
    elif strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        module = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                                          device_id=torch.device("cpu"))
    else:
        import deepspeed
        import deepspeed.comm.torch as ds_torch

        ds_torch.build_shm_op = lambda: None  # gloo carries the collectives; no op to compile
        config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                  "train_batch_size": batch * dist.get_world_size(), "zero_optimization": zero,
                  "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                  "steps_per_print": 1 << 30}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                               config=config)
        return engine, engine.backward, engine.step
    optimizer = torch.optim.AdamW(module.parameters())

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return module, lambda loss: loss.backward(), step


def real_rank_peaks(runs: list[tuple[str, int, dict[str, Any] | None]]) -> list[Any]:
    """Each (strategy, batch, ZeRO section) trained for real on this rank, two AdamW steps; the peak
    of what the device holds, counted by tests/independent_tracker.py. Every rank's figures, gathered."""
    import gc
    import logging

    from tests.independent_tracker import StorageCounter

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    peaks = []
    for strategy, batch, zero in runs:
        torch.manual_seed(dist.get_rank())
        model = blocks()
        counter = StorageCounter()
        with counter:
            module, backward, step = _wrap_as_users_do(model, strategy, batch, zero)
            counter.hold([*module.parameters(), *module.buffers()])
            for _ in range(2):
                backward(module(long_batch(batch)).float().mean())
                step()
        peaks.append(counter.peak)
        del module, backward, step, model
        gc.collect()
        if strategy.startswith("zero"):
            from deepspeed.utils import groups

            groups._WORLD_GROUP = None  # a fresh engine next, as in a fresh job
    return gathered(peaks)
