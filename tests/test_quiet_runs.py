"""A sharded run says nothing alarming that is not about the user's setup: neither DeepSpeed's
"Setting accelerator to CPU … we were unable to detect it" (the CPU is used on purpose) nor torch's
"Accessing the data pointer of FakeTensor … almost definitely a bug" (FSDP1 traced on fake tensors)."""

from __future__ import annotations

import subprocess
import sys

from .extras import need


def test_a_sharded_estimate_prints_no_alarming_warning():
    need("deepspeed")
    run = subprocess.run(
        [sys.executable, "-c", "from autobatch.cli import main; main()", "estimate", "--model", "tiny-llama",
         "--gpus", "4", "--strategy", "fsdp1,zero1", "--max-micro", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "Setting accelerator to CPU" not in run.stderr + run.stdout
    assert "data pointer of FakeTensor" not in run.stderr + run.stdout
    assert "fsdp1" in run.stdout and "zero1" in run.stdout
