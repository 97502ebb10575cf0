"""The liger kernel sets with liger-kernel's own kernels, on CPU: Triton's interpreter runs liger 0.8.5's
RMSNorm, SwiGLU, RoPE and fused linear cross-entropy kernels (tests/liger_interpreted.py, in a process of its
own). tests/test_kernel_sets.py checks the sets' wiring against a stand-in of liger's functions; this checks
the real functions' signatures, return values and numerics against transformers' own modules, the reference.

The interpreter runs fp32 only here: its bf16 (numpy has none) gives SwiGLU and RoPE wrong values where
compiled Triton does not (tests/test_kernels_cuda.py checks bf16 on a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / ".venv" / "liger-interpret"
"""triton 3.6.0 and liger-kernel 0.8.5, installed there by scripts/setup.sh (not into the venv itself,
where liger would count as installed for `model.kernels: auto`)."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def interpreted() -> dict:
    if not (SIDE / "liger_kernel").is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{SIDE} is missing: scripts/setup.sh installs it")
        pytest.skip(f"{SIDE} is missing: run scripts/setup.sh")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(SIDE)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "liger_interpreted.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_liger_set_trains_as_transformers_modules_do_with_ligers_own_kernels(interpreted) -> None:
    """Loss within 1e-5 relative and every gradient within 1e-5 of its largest entry (fp32 rounding: the
    kernels sum in other orders), with every norm, MLP and RoPE of the 2-layer model and the loss run by
    liger."""
    result = interpreted["sets"]["liger"]
    assert result["calls"] == {"liger_rms_norm": 5, "liger_swiglu": 2, "liger_rotary_pos_emb": 2,
                               "fused_linear_cross_entropy_forward": 1}
    assert abs(result["loss"] - result["reference_loss"]) <= 1e-5 * abs(result["reference_loss"])
    assert result["worst_grad"] <= 1e-5


def test_the_liger_loss_set_runs_ligers_loss_alone(interpreted) -> None:
    result = interpreted["sets"]["liger_loss"]
    assert result["calls"] == {"fused_linear_cross_entropy_forward": 1}
    assert abs(result["loss"] - result["reference_loss"]) <= 1e-5 * abs(result["reference_loss"])
    assert result["worst_grad"] <= 1e-5


def test_the_loss_without_ligers_host_read_is_ligers_loss_bit_for_bit(interpreted) -> None:
    """workers/kernels/liger_linear_ce.py's backward (no torch.equal) against liger's own function under a
    gradient of 0.37; the loss against torch's cross_entropy of the full logits within 1e-6."""
    assert interpreted["linear_ce"]["equal"]
    assert interpreted["linear_ce"]["loss_vs_torch"] <= 1e-6


def test_what_ligers_forward_keeps_is_what_the_memory_model_counts(interpreted) -> None:
    """The liger set's bytes per token kept for the backward (bf16; saved-tensor hooks), without recompute
    and recomputing every 2nd layer, within 2% of the memory model's count, as the torch set's are (the
    control; the ledger checks it in tests/test_activation_memory.py). tests/test_kernels_cuda.py measures
    the same on a GPU at 1-2k tokens."""
    for name in ("torch", "liger", "liger, recompute every 2"):
        kept, modeled = interpreted["kept"][name]["kept"], interpreted["kept"][name]["modeled"]
        assert modeled == pytest.approx(kept, rel=0.02), (name, kept, modeled)
