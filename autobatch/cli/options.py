"""Options several commands share: one name, one type and one help text per concept.

Names, everywhere: ``--gpus`` (per node) × ``--nodes`` is the data-parallel world size;
``--micro-batch``/``--grad-accum`` a given setup; ``--max-micro``/``--min-micro``/``--multiple-of``
the limits on the per-GPU batch; ``--grad-checkpointing`` a flag; ``--deepspeed``/``--accelerate``/
``--hf`` the config files a plan is written to. Every command that takes ``--model`` takes the
same model options (:data:`ModelSpec`, :data:`SeqLen`, :data:`InputShape`, :data:`NumClasses`,
:data:`TrustRemoteCode`). Values are checked here, naming the flag the user typed.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..errors import AutobatchError

__all__ = [
    "AsJson", "AccelerateOut", "DeepSpeedOut", "DeviceName", "Dtype", "GpuMemory", "GpuName", "GpusPerNode",
    "GradCheckpointing", "GradsHeld", "Headroom", "HfOut", "InputShape", "MaxMicro", "MinMicro", "ModelParallel",
    "ModelSpec",
    "MultipleOf", "Nodes", "NumClasses", "OptimizerName", "Script", "SeqLen", "SeqLens", "Evaluation", "TrainSeqLen",
    "SimulatedMemory", "Target", "StrategyOption", "Uneven", "OffloadOption", "FsdpUnitOption",
    "TrustRemoteCode", "Attention", "CudaContext", "headroom_value", "size_value", "model_load_options",
    "FindTarget", "GpusHere", "NoCache", "NoTracePrior", "PlotOut", "Timeout", "Fragmentation", "Workspace",
    "FLAGS", "parse_seq_lens", "request_from",
]

# Each field of autobatch.Request as its flag: errors name the option as the user typed it.
FLAGS = {
    "model": "--model", "seq_len": "--seq-len", "train_seq_len": "--train-seq-len", "evaluation": "--eval",
    "input_shape": "--input-shape", "num_classes": "--num-classes", "trust_remote_code": "--trust-remote-code",
    "attention": "--attention", "cuda_context": "--cuda-context",
    "dtype": "--dtype", "optimizer": "--optimizer", "grad_checkpointing": "--grad-checkpointing",
    "grads_held": "--grads-held",
    "target": "--target", "gpus_per_node": "--gpus", "nodes": "--nodes", "model_parallel": "--model-parallel",
    "max_micro": "--max-micro", "min_micro": "--min-micro", "multiple_of": "--multiple-of",
    "base_lr": "--base-lr", "base_batch": "--base-batch", "headroom": "--headroom", "strategy": "--strategy",
    "offload": "--offload", "fsdp_unit": "--fsdp-unit", "device": "--device", "memory": "--memory",
    "gpu": "--gpu", "gpu_memory": "--gpu-memory", "fragmentation": "--fragmentation", "workspace": "--workspace",
    "cache": "--no-cache", "trace_prior": "--no-trace-prior", "timeout": "--timeout", "deepspeed": "--deepspeed",
    "accelerate": "--accelerate", "hf": "--hf", "plot": "--plot", "keep_auto": "--keep-auto", "script": "--script",
    "uneven": "--uneven",
    # a setup that `check` and `verify-ga` read, and their own options
    "micro_batch": "--micro-batch", "grad_accum": "--grad-accum", "tolerance": "--tolerance", "seed": "--seed",
}
_RENAMED = {"gpus": "gpus_per_node"}
_NEGATED = {"no_cache": "cache", "no_trace_prior": "trace_prior"}
_CLI_ONLY = {"as_json"}

_MODEL = "Model"
_PLAN = "Plan"
_OUT = "Output"

ModelSpec = Annotated[str, typer.Option(
    "--model", rich_help_panel=_MODEL,
    help="A built-in name (`autobatch models`), hf:NAME_OR_DIR, or your own file.py:fn or package.module:fn. "
         "hf: trains with the head its config's architectures names (sequence or token classification, image "
         "classification, seq2seq conditional generation), else as a causal LM (else masked). "
         "file.py:fn and module:fn import and run that code (as `python file.py` would): pass only code you trust.",
)]
SeqLen = Annotated[int | None, typer.Option(
    "--seq-len", min=1, rich_help_panel=_MODEL, show_default="the model's own, e.g. 1024 for gpt2",
    help="Tokens per sample, the longest you train on.",
)]
SeqLens = Annotated[str | None, typer.Option(
    "--seq-len", rich_help_panel=_MODEL, show_default="the model's own, e.g. 1024 for gpt2",
    help="Tokens per sample, the longest you train on; several (256,512,1024) give one row per length and max_tokens.",
)]
Evaluation = Annotated[bool, typer.Option(
    "--eval", rich_help_panel=_MODEL,
    help="Also find the largest evaluation batch (forward under torch.no_grad()) at the same shapes.",
)]
TrainSeqLen = Annotated[int | None, typer.Option(
    "--train-seq-len", min=1, rich_help_panel=_MODEL,
    help="With several --seq-len: the length the plan is for (default the longest).",
)]
InputShape = Annotated[str | None, typer.Option(
    "--input-shape", rich_help_panel=_MODEL,
    help="Per-sample input shape when your own fn returns an nn.Module, e.g. 3,224,224.",
)]
NumClasses = Annotated[int, typer.Option(
    "--num-classes", min=1, rich_help_panel=_MODEL, help="Classes for your own nn.Module's classification loss.",
)]
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", rich_help_panel=_MODEL, help="Let an hf: model run the code it ships with.",
)]
Attention = Annotated[str | None, typer.Option(
    "--attention", rich_help_panel=_MODEL,
    help="sdpa or eager: the attention a built-in or hf: transformers model is built with. eager keeps the "
         "attention probabilities (O(seq²) a layer; 9.6 GiB more for gpt2 at 8 × 1024 on an H200). Default: "
         "the model's own (sdpa).",
)]
Dtype = Annotated[str, typer.Option(
    "--dtype", rich_help_panel=_MODEL,
    help="fp32; bf16 or fp16 (autocast, fp32 weights; under FSDP also its mixed precision: parameters gathered and "
         "gradients reduced in that dtype, as accelerate and Lightning set it; under ZeRO, DeepSpeed's engine: weights "
         "in that dtype beside fp32 master shards, no autocast); bf16-true or fp16-true (the weights, their gradients "
         "and the optimizer's state in that dtype, as Lightning's bf16-true and torchtune train; not with ZeRO).",
)]
OptimizerName = Annotated[str, typer.Option(
    "--optimizer", rich_help_panel=_MODEL,
    help="adamw, adam, sgd, sgd-nomomentum, adafactor, or adamw8bit (bitsandbytes' AdamW8bit as memory: "
         "uint8 moments and an absmax per 256 elements; bitsandbytes not needed).",
)]
GradCheckpointing = Annotated[bool, typer.Option(
    "--grad-checkpointing", rich_help_panel=_MODEL, help="Train with gradient checkpointing on.",
)]
GradsHeld = Annotated[bool, typer.Option(
    "--grads-held", rich_help_panel=_MODEL,
    help="The gradients stay allocated into the next forward: every accumulation micro-step after the first, or "
         "a loop that zeroes them with zero_grad(set_to_none=False). The forward's peak holds them too (up to "
         "4 bytes per fp32 parameter); unsharded steps (DDP) only.",
)]

Target = Annotated[int, typer.Option("--target", min=1, rich_help_panel=_PLAN, help="Global batch per optimizer step.")]
GpusPerNode = Annotated[int | None, typer.Option(
    "--gpus", min=1, rich_help_panel=_PLAN, help="GPUs per node (not the total: world size = --gpus × --nodes).",
)]
Nodes = Annotated[int, typer.Option("--nodes", min=1, rich_help_panel=_PLAN, help="Number of nodes.")]
ModelParallel = Annotated[int, typer.Option(
    "--model-parallel", min=1, rich_help_panel=_PLAN, help="Tensor × pipeline parallel degree.",
)]
MaxMicro = Annotated[int | None, typer.Option(
    "--max-micro", min=1, rich_help_panel=_PLAN, help="Largest per-GPU batch allowed (no trial goes above it).",
)]
MinMicro = Annotated[int | None, typer.Option(
    "--min-micro", min=1, rich_help_panel=_PLAN, show_default="2 with BatchNorm, else 1",
    help="Smallest per-GPU batch.",
)]
MultipleOf = Annotated[int | None, typer.Option(
    "--multiple-of", min=1, rich_help_panel=_PLAN, help="Per-GPU batch must be a multiple of this.",
)]
Headroom = Annotated[str, typer.Option(
    "--headroom", help="Memory kept free for the safe batch: 5%, 0.05 or 2GiB.",
)]
DeviceName = Annotated[str | None, typer.Option(
    "--device", show_default="every CUDA GPU here", help="cuda, cuda:N, or cpu (with --memory: a simulated budget).",
)]
SimulatedMemory = Annotated[str | None, typer.Option(
    "--memory", help="Simulated device memory for --device cpu, e.g. 2GiB; under a launcher one per rank, e.g. 60MiB,40MiB.",
)]
GpuName = Annotated[str | None, typer.Option(
    "--gpu", show_default="a100-80gb",
    help="A GPU from `autobatch gpus` to estimate for, or a mixed job's cards with their counts in rank order: "
         "a100-80gb:4,a100-40gb:4 (the uniform plan takes the smallest card's batch; --uneven plans each).",
)]
Uneven = Annotated[bool, typer.Option(
    "--uneven", rich_help_panel=_PLAN,
    help="Mixed GPUs: plan each rank its own micro batch × accumulation, Σ = --target exactly, balanced by each "
         "rank's step time (DDP: accumulation per rank; FSDP/ZeRO: one accumulation). find: every rank of a "
         "launcher probes its own max; estimate: per card of a mixed --gpu list. Config files keep the uniform "
         "plan; the plan per rank is printed and in --json (per_rank).",
)]
GpuMemory = Annotated[str | None, typer.Option(
    "--gpu-memory", help="Estimate for a GPU not in `autobatch gpus` by its total memory, e.g. 40GiB (instead of --gpu).",
)]

StrategyOption = Annotated[str | None, typer.Option(
    "--strategy", rich_help_panel=_PLAN,
    help="How training shards: ddp, fsdp2, fsdp1, zero1, zero2, zero3, or a list (ddp,fsdp2,zero3: one row each).",
)]
OffloadOption = Annotated[str | None, typer.Option(
    "--offload", rich_help_panel=_PLAN,
    help="ZeRO: optimizer (its state in host memory) or params (ZeRO-3: the parameters too). "
         "FSDP: params (CPUOffloadPolicy, CPUOffload: the shards, their gradients and the optimizer step on the host). "
         "In a list, each strategy that takes it. Estimated, or probed on a GPU: a simulated budget on the CPU "
         "refuses it (the host it would offload to is the device).",
)]
FsdpUnitOption = Annotated[str | None, typer.Option(
    "--fsdp-unit", rich_help_panel=_PLAN, show_default="the model's transformer block; solve: by size",
    help="FSDP only: the module class wrapped as one unit. find and estimate take the block the model has "
         "(by size, 100,000,000 parameters a unit, where it has none); solve knows no model and wraps by size.",
)]

FindTarget = Annotated[int | None, typer.Option(
    "--target", min=1, rich_help_panel=_PLAN, show_default="the safe batch on every GPU",
    help="Global batch per optimizer step.",
)]
GpusHere = Annotated[int | None, typer.Option(
    "--gpus", min=1, rich_help_panel=_PLAN, show_default="the GPUs visible here; 1 on CPU",
    help="GPUs per node (not the total: world size = --gpus × --nodes).",
)]
NoCache = Annotated[bool, typer.Option("--no-cache", help="Probe again even when a result for this setup is cached.")]
NoTracePrior = Annotated[bool, typer.Option(
    "--no-trace-prior",
    help="By default a fake-tensor trace of the training step leads the search once it is ready (fewer trials, "
         "the same exact max batch; on the CPU it runs between the trials, or, for a sharded probe, beside them "
         "at the lowest priority, and is waited for only where it should save more than it costs). "
         "This searches with real trials alone; the safe batch, predicted between trials, may "
         "differ by a few. A cached answer is shown as it is: add --no-cache to search again.",
)]
PlotOut = Annotated[str | None, typer.Option(
    "--plot", rich_help_panel=_OUT, help="Draw peak memory against batch into this PNG (needs the plot extra).",
)]
Timeout = Annotated[float, typer.Option(
    "--timeout", min=1.0,
    help="Seconds a rank waits for the others (under a launcher, or one worker per GPU here) before all stop with one error.",
)]
Fragmentation = Annotated[float | None, typer.Option(
    "--fragmentation", help="The allocator's reserved ÷ allocated peak, multiplying the traced peak. Default: "
    "book each traced step's requests through a model of PyTorch's caching allocator on the card (within 0.1 % "
    "of the reserved peaks an H200 measured, docs/benchmarks/gpu.md), a sharded trial's as a fresh run makes them "
    "(--strategy), each row of a length table's (several --seq-len) as one length's.")]
Workspace = Annotated[str, typer.Option("--workspace", help="cuBLAS/cuDNN workspaces assumed.")]
CudaContext = Annotated[str | None, typer.Option(
    "--cuda-context", help="The CUDA context's memory per process, e.g. 1.3GiB. Default: the card's catalogue "
    "value (`autobatch gpus`); it grows as kernels load (an H200 on CUDA 13: 0.60 GiB at start, 0.75 GiB once a "
    "model trained), and CUDA before 11.7 loads them all at start (1.31 GiB on a V100, CUDA 11.2).")]

DeepSpeedOut = Annotated[str | None, typer.Option(
    "--deepspeed", rich_help_panel=_OUT,
    help="Write the plan into this DeepSpeed JSON: the batch keys, and what the batch was probed with (the ZeRO "
         "stage, offload and bucket sizes; bf16/fp16). Its other keys are kept.",
)]
AccelerateOut = Annotated[str | None, typer.Option(
    "--accelerate", rich_help_panel=_OUT, help="Write an accelerate config YAML here.",
)]
HfOut = Annotated[str | None, typer.Option(
    "--hf", rich_help_panel=_OUT,
    help="Write HF TrainingArguments values (JSON) here: the batch, and what it was probed with (fsdp or deepspeed "
         "with its stage, offload and bucket sizes; bf16/fp16; gradient checkpointing).",
)]
Script = Annotated[str, typer.Option(
    "--script", rich_help_panel=_OUT, help="Training script shown in the launch lines.",
)]
AsJson = Annotated[bool, typer.Option(
    "--json", rich_help_panel=_OUT, help="Print one JSON object on stdout (errors too, as {\"error\": …}).",
)]


def size_value(text: str, flag: str, *, zero: bool = False) -> int:
    """A memory size such as ``2GiB``; a bad one is an error that names ``flag``. ``zero``: ``0B`` is one.

    On the command line a size needs its unit: ``--memory 4`` would be four bytes, which nobody means.
    """
    from ..units import parse_bytes

    if text.strip().replace(".", "", 1).isdigit():
        if float(text) == 0 and zero:
            return 0  # nothing is nothing in any unit
        if float(text) == 0:
            raise AutobatchError(f"{flag} must be a positive size with a unit, but got {text!r}; write e.g. 2GiB")
        example = text.strip()
        raise AutobatchError(f"{flag} needs a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), but got {text!r}; "
                             f"write e.g. {example}GiB")
    try:
        return parse_bytes(text, zero=zero)
    except AutobatchError:
        raise AutobatchError(
            f"{flag} must be {'a size of 0B or more' if zero else 'a positive size'} with a unit "
            "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), "
            f"but got {text!r}; write e.g. 2GiB"
        ) from None


def headroom_value(text: str) -> float | str:
    """``--headroom`` as the library takes it: a fraction (``0.05``, ``5%``) or a size (``2GiB``)."""
    value = text.strip()
    try:
        fraction = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        fraction = None
    if fraction is not None:
        if not 0 <= fraction < 1:
            raise AutobatchError(f"--headroom as a fraction must be in [0, 1), but got {text!r}; write e.g. 5% or 0.05")
        return fraction
    try:
        size_value(value, "--headroom")
    except AutobatchError:
        raise AutobatchError(
            f"--headroom must be a fraction (0.05), a percentage (5%) or a size (2GiB), but got {text!r}"
        ) from None
    return value


def model_load_options(seq_len: int | None, input_shape: str | None, num_classes: int,
                       trust_remote_code: bool) -> dict[str, Any]:
    """The keyword arguments of :func:`autobatch.models.load_model` from the shared model options."""
    return dict(seq_len=seq_len, input_shape=input_shape, num_classes=num_classes,
                trust_remote_code=trust_remote_code)


def parse_seq_lens(text: str | None) -> tuple[int, ...] | None:
    """``"256,512,1024"`` → ``(256, 512, 1024)``; ``None`` stays ``None``."""
    if text is None:
        return None
    parts = text.split(",")
    try:  # an empty part ("32,,64", "64,") is a typo, not a length left out
        lengths = [int(part) for part in parts] if all(part.strip() for part in parts) else []
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise AutobatchError(
            f"--seq-len must be one positive integer or several separated by commas, but got {text!r}; "
            "write e.g. --seq-len 1024 or --seq-len 256,512,1024,2048"
        )
    return tuple(dict.fromkeys(lengths))


def request_from(params: dict[str, Any], **fixed: Any) -> Any:
    """The :class:`autobatch.Request` a command's flags make: ``params`` are its parameters by name.

    Sizes need their unit and ``--headroom`` reads as a fraction or a size, as everywhere on the
    command line; ``--no-cache``/``--no-trace-prior`` turn the request's ``cache``/``trace_prior`` off.
    """
    from .. import Request

    kwargs: dict[str, Any] = {}
    for name, value in params.items():
        if name in _NEGATED:
            kwargs[_NEGATED[name]] = not value
        elif name not in _CLI_ONLY:
            kwargs[_RENAMED.get(name, name)] = value
    for name in ("memory", "gpu_memory", "workspace", "cuda_context"):
        if kwargs.get(name) is not None:
            for part in kwargs[name].split(",") if name == "memory" else [kwargs[name]]:  # one per rank
                # overheads may be none: the library's answering.sizes names the same two (the CLI takes no private names)
                size_value(part, FLAGS[name], zero=name in ("workspace", "cuda_context"))
    if "headroom" in kwargs:
        kwargs["headroom"] = headroom_value(kwargs["headroom"])
    if isinstance(kwargs.get("seq_len"), str):
        kwargs["seq_len"] = parse_seq_lens(kwargs["seq_len"])
    return Request(**{**kwargs, **fixed})
