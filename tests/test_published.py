"""The published-measurements benchmark (benchmarks/published.py): its data, its rules, its table."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import published
from benchmarks.published_models import BUILDERS, build

ROOT = Path(__file__).resolve().parents[1]
OBSERVATIONS = published.load()
BY_ID = {o["id"]: o for o in OBSERVATIONS}


def _said(obs):
    """What the record says of a run: its quote, notes, framework and gaps, and those of the run it is told as."""
    text = " ".join([obs["quote"], obs.get("notes") or "", obs.get("framework") or "", *obs.get("missing", [])])
    same = re.search(r"Same setup as ([\w.-]+?)[;.]? ", text)
    return text + (" " + _said(BY_ID[same.group(1)]) if same else "")


def test_at_least_twenty_observations_each_with_its_source_and_quote():
    assert len(OBSERVATIONS) >= 20
    assert len({o["id"] for o in OBSERVATIONS}) == len(OBSERVATIONS)
    for obs in OBSERVATIONS:
        assert obs["source_url"].startswith("http") and len(obs["quote"]) > 20, obs["id"]
        assert obs["outcome"] in ("fit", "oom", "peak") and obs["per_gpu_batch"] >= 1, obs["id"]
        assert (obs["peak_bytes_measured"] is not None) == (obs["outcome"] == "peak"), obs["id"]
        assert obs["model"] in BUILDERS, obs["id"]
        assert obs["attention"] in ("eager", "sdpa") and obs["attention_basis"], obs["id"]
    assert {o["outcome"] for o in OBSERVATIONS} == {"fit", "oom", "peak"}


def test_what_a_point_lacks_is_said():
    by_id = {o["id"]: o for o in OBSERVATIONS}
    assert published.lacks(by_id["hf-perf-bert-large-v100-bs4-fp32"]) == []
    assert any("TensorFlow" in said for said in published.lacks(by_id["google-bert-large-seq384-titanx-bs1-oom"]))
    assert any("not named" in said for said in published.lacks(by_id["litgpt-llama-2-7b-full-4xa100-fsdp-mb4-peak"]))
    # ZeRO's and FSDP's offload are estimated (the host's tensors apart)
    assert published.lacks(by_id["zero-blog-t5-3b-rtx3090-deepspeed-offload-bs20-fit"]) == []
    assert published.lacks(by_id["ds-blog-deberta-v2-xlarge-zero2-fp16-bs40"]) == []  # "offload_optimizer_device none"
    assert published.lacks(by_id["fsdp-blog-gpt2-xl-fsdp-offload-1gpu-bs10"]) == []  # as fsdp1 --offload params
    # every source's FSDP is FSDP1 (PyTorch 1.12 under accelerate, Lightning Fabric's FSDPStrategy): estimated so
    assert {o["framework"].split()[0] for o in OBSERVATIONS if o["strategy"] == "fsdp"} == {"Accelerate", "LitGPT"}
    assert published.STRATEGIES["fsdp"] == "fsdp1"


def test_a_peak_is_compared_with_the_figure_its_source_read():
    got = {"fits": True, "reserved": 900, "allocated": 800, "context": 100, "capacity": 10_000}
    smi = {"outcome": "peak", "peak_bytes_measured": 1000, "peak_measured_by": "nvidia-smi"}
    allocated = {"outcome": "peak", "peak_bytes_measured": 1000, "peak_measured_by": "max_memory_allocated"}
    assert published._error(smi, got) == 0.0  # reserved + the CUDA context
    assert published._error(allocated, got) == -0.2
    assert published._error({**smi, "outcome": "fit"}, got) is None


def test_the_committed_table_is_the_one_its_record_gives():
    rows = json.loads((ROOT / "docs/benchmarks/published.json").read_text())
    committed = (ROOT / "docs/benchmarks/published.md").read_text().splitlines()
    written = published.markdown(rows, []).splitlines()
    # The command line and date (line 3) are the run's; everything else must match.
    assert committed[:2] + committed[3:] == written[:2] + written[3:]
    assert len(rows) == len(OBSERVATIONS)


def test_each_run_steps_its_optimizer_as_its_source_did():
    # The step's temporaries differ: one parameter's (one-tensor), all parameters' (multi-tensor, torch's
    # default on a GPU since 2.0, as the estimate steps it) or none (fused).
    steps = {obs["id"]: published.optimizer_step(obs) for obs in published.load()}
    assert steps["hf-perf-bert-large-v100-bs4-fp32"] == "one-tensor"  # transformers v4.21's Trainer
    assert steps["zero-blog-t5-large-ddp-fp32-bs16"] == "one-tensor"  # PyTorch 1.7.1
    assert steps["nanogpt-gpt2-124m-8xa100-40gb-bs12"] == "fused"
    assert steps["litgpt-llama-3.2-1b-full-a10g-mb4"] == "multi-tensor"


def test_gradients_are_held_where_the_run_kept_them():
    by_id = {o["id"]: o for o in OBSERVATIONS}
    # torch before 2.0 zeroed gradients in place by default: a Trainer of that time kept them into each forward
    assert published.grads_held(by_id["hf-perf-bert-large-v100-bs4-fp32"])
    assert published.grads_held(by_id["timm-resnet50-rtx3090-amp-bs512"])  # PyTorch 1.12
    assert published.grads_held(by_id["nanogpt-gpt2-124m-8xa100-40gb-bs12"])  # torch 2, but 5 micro-steps a step
    assert not published.grads_held({**by_id["nanogpt-gpt2-124m-8xa100-40gb-bs12"], "grad_accum": 1})
    assert not published.grads_held(by_id["litgpt-llama-2-7b-full-4xa100-fsdp-mb4-peak"])  # a wrapper's own


def test_a_context_is_taken_from_the_source_only_where_it_measured_one():
    measured = [o for o in OBSERVATIONS if o.get("context_bytes_measured")]
    assert len(measured) == 9
    for obs in measured:  # the HF docs page measured 1343 MB after torch.ones((1, 1)).to("cuda")
        assert "1343 MB after torch.ones" in obs["notes"] and obs["context_bytes_measured"] == 1343 * 2**20



def test_a_seq2seq_run_trains_its_own_target_length_and_freezes_what_it_froze():
    import transformers

    for obs in OBSERVATIONS:
        said_ = _said(obs)
        # Every run that names its target length is estimated with it; every one that froze the embeddings, so.
        targets = {int(n) for n in re.findall(r"max_target_length (\d+)", said_)}
        assert (obs.get("target_len") is not None) == bool(targets) and obs.get("target_len") in targets | {None}, obs["id"]
        assert (obs.get("frozen") == ["shared"]) == ("freeze_embeds" in said_), obs["id"]
    blender = BY_ID["ds-blog-blenderbot-400m-zero2-fp16-bs200"]
    _, make = build(blender["model"], blender["task_head"], "eager", blender["target_len"])
    batch = make(3, blender["seq_len"], None)
    assert batch["input_ids"].shape == (3, 128) and batch["labels"].shape == (3, 64)
    # T5's LM head is tied to the shared embedding: freezing the one freezes the other, nothing else
    config = transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=50)
    model = published.frozen(transformers.T5ForConditionalGeneration(config), ["shared"])
    still = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not model.shared.weight.requires_grad and not model.lm_head.weight.requires_grad
    assert still and all("shared" not in name and "embed_tokens" not in name for name in still)
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == 50 * 16


def test_a_run_that_pads_each_batch_to_its_longest_sample_says_so():
    for obs in OBSERVATIONS:
        text = _said(obs)
        per_batch = any(mark in text for mark in ("trims each batch", "dynamic padding", "padded per batch", "Alpaca",
                                                  "finetune_trainer.py", "run_glue_no_trainer", "run_cls_no_trainer"))
        padded = re.search(r"(?<!no )(?<!only with )--pad_to_max_length", text) is not None  # the flag, not its absence
        assert obs["padding"] == ("max_length" if padded else "longest" if per_batch else None), obs["id"]
        assert any("dynamic padding" in c for c in published.caveats(obs)) == (obs["padding"] == "longest"), obs["id"]


def test_a_zero_run_is_estimated_with_the_buckets_its_deepspeed_config_held():
    # What the source says the config held (or, for accelerate's plugin, which writes none, DeepSpeed's defaults).
    from tests.extras import need

    need("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    held = {o["id"]: o["deepspeed"] for o in OBSERVATIONS if o.get("deepspeed")}
    assert set(held) == {"ds-blog-blenderbot-400m-zero2-fp16-bs200", "ds-blog-deberta-v2-xlarge-zero2-fp16-bs40"}
    for name, zero in held.items():
        obs = BY_ID[name]
        resolved = DeepSpeedZeroConfig(**zero)
        assert obs["strategy"] == f"zero{resolved.stage}", name
        assert ("2e8" in obs["notes"]) == (resolved.reduce_bucket_size == 2e8) and "bucket" in obs["notes"], name
        assert resolved.overlap_comm == ("overlap_comm" in obs["notes"] and "overlap_comm off" not in obs["notes"]), name


def test_a_peak_below_what_its_stated_setup_must_hold_is_said():
    import torch

    model = torch.nn.Linear(64, 64)  # 4,096 weights and 64 biases in fp32: 16,640 bytes
    assert published.floor_bytes(model, "adamw") == 16_640 + 2 * 16_640
    assert published.floor_bytes(model, "sgd") == 2 * 16_640
    # bitsandbytes: uint8 moments and an absmax per 256 for the 4,096 weights, float32 moments for the 64 biases
    assert published.floor_bytes(model, "adamw8bit") == 16_640 + (2 * 4096 + 2 * 4 * 16) + 2 * 4 * 64
    model.bias.requires_grad_(False)  # frozen: no state
    assert published.floor_bytes(model, "adamw") == 16_640 + 2 * 16_384
    obs = {**BY_ID["litgpt-phi-3-mini-full-a10g-mb4"]}
    below = published.said(obs, {"floor": obs["peak_bytes_measured"] + 1})
    assert any("below the" in s and "not the run as stated" in s for s in below)
    assert not any("below the" in s for s in published.said(obs, {"floor": obs["peak_bytes_measured"]}))
    assert not any("below the" in s for s in published.said({**obs, "outcome": "fit"}, {"floor": 1 << 40}))
