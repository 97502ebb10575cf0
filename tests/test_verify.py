"""`python -m app verify`: the user-facing parity check (tiny Qwen2, CP=2 over gloo), and its choice of
process-group backend on a GPU host (simulated: torch.cuda.is_available / device_count patched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.__main__ import main
from scheduling.payload import IGNORE_INDEX


@pytest.mark.slow
def test_verify_json_all_distributed(capsys) -> None:
    code = main(["verify", "--cp", "2", "--model", "tiny-qwen2", "--lengths", "1,2,30,64",
                 "--distribute", "all", "--backend", "gloo", "--json"])  # gloo: CPU on any host
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, out
    assert {"loss_abs_diff", "grad_max_abs_diff", "grad_max_rel_diff", "tolerance", "ok"} <= set(out)
    assert out["ok"] is True and out["tolerance"] == 1e-5 and out["backend"] == "gloo"
    assert out["plan"] == {"local": [[], []], "distributed": [0, 1, 2, 3]}
    assert out["grad_max_rel_diff"] <= 1e-5 and out["hf_own_grad_max_rel_diff"] is None
    assert out["reference_device"] == "cpu"


@pytest.mark.slow
def test_verify_in_bf16_is_held_to_the_hf_models_own_bf16_error(capsys) -> None:
    """bf16 against the fp32 reference: the bound is 5e-2, or 1.5x the error of the HF model's own bf16
    forward/backward on the same weights and tokens when that is larger (deep models); fp32 has no floor."""
    code = main(["verify", "--cp", "2", "--model", "tiny-qwen2", "--lengths", "3,40,200", "--dtype", "bf16",
                 "--backend", "gloo", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["ok"] is True, out
    floor = out["hf_own_grad_max_rel_diff"]
    assert 0 < floor < 5e-2 and out["tolerance"] == max(5e-2, 1.5 * floor)
    assert out["grad_max_rel_diff"] <= max(5e-2, 1.5 * floor)


@pytest.mark.parametrize("dtype, backend, first_fits, devices", [
    ("bf16", "nccl", True, ["cuda", "cuda"]),          # both references beside the ranks
    ("bf16", "nccl", False, ["cuda", "cpu", "cuda"]),  # the fp32 one out of GPU memory: on the CPU
    ("bf16", "gloo", True, ["cpu", "cpu"]),
    ("fp32", "nccl", True, ["cpu"]),                   # fp32 parity (1e-5) is always judged on the CPU
])
def test_the_reference_runs_where_the_ranks_ran_for_bf16(monkeypatch, dtype, backend, first_fits,
                                                         devices) -> None:
    """A stand-in for the references (no CUDA here): which device each is asked for, and the fallback."""
    import torch

    from workers.tools import parity

    asked: list[str] = []

    def reference(spec, weights, ids, labels, total, *, fp32=True, device="cpu"):
        asked.append(device)
        if device == "cuda" and fp32 and not first_fits and len(asked) == 1:
            raise torch.cuda.OutOfMemoryError("stand-in")
        return 1.0, {"w": torch.ones(2)}

    monkeypatch.setattr(parity, "_reference", reference)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    spec = parity.ParitySpec(model="tiny-qwen2", lengths=(3,), cp_size=1, dtype=dtype)
    case = parity._Case(spec, "", None, [[1, 2, 3]], [[1, 2, 3]], 2, 1)
    result = parity._judge(case, [{"loss": 1.0, "grads": {"w": torch.ones(2)}, "tokens": 3}], backend)
    assert asked == devices and result["ok"] is True
    assert result["reference_device"] == devices[1 if not first_fits else 0]


def test_verify_rejects_bad_lengths(capsys) -> None:
    assert main(["verify", "--lengths", "3,x"]) == 2
    assert "--lengths" in capsys.readouterr().err
    assert main(["verify", "--lengths", "0,4"]) == 2


def _pretend_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_verify_refuses_two_nccl_ranks_on_one_gpu(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """NCCL cannot put two ranks on one GPU ("Duplicate GPU"): exit 2 naming --cp before a process starts."""
    _pretend_gpus(monkeypatch, 1)
    assert main(["verify", "--cp", "2", "--lengths", "3,40"]) == 2
    err = capsys.readouterr().err
    assert "--cp 2 over NCCL needs 2 GPUs" in err and "this machine has 1" in err and "--backend gloo" in err
    _pretend_gpus(monkeypatch, 0)
    assert main(["verify", "--cp", "1", "--lengths", "3,40", "--backend", "nccl"]) == 2
    assert "--backend nccl needs CUDA" in capsys.readouterr().err


def test_the_backend_follows_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.commands.verify import resolve_backend
    from workers.tools.launch import check_gpus_for

    _pretend_gpus(monkeypatch, 2)
    assert resolve_backend("auto", 2) == "nccl" and resolve_backend("gloo", 4) == "gloo"
    check_gpus_for("nccl", 2)
    with pytest.raises(ValueError, match="3 NCCL ranks need 3 GPUs"):
        check_gpus_for("nccl", 3)  # run_workers' own guard, for every caller
    _pretend_gpus(monkeypatch, 0)
    assert resolve_backend("auto", 2) == "gloo"


def _rank_on_a_gpu_host(rank: int, world: int, *args) -> dict:
    """parity's rank function in a process where CUDA looks available (its group is gloo); also what
    run_workers hid from this gloo rank."""
    import os

    hidden = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")}
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    from workers.tools.parity import _rank

    return _rank(rank, world, *args) | {"hidden": hidden}


def test_parity_ranks_over_gloo_stay_on_cpu_on_a_gpu_host(tmp_path: Path) -> None:
    """backend="gloo" (the tests' CP=2 parity runs) keeps the model on CPU whatever the host has: the rank
    picks its device by its group's backend, and run_workers hides the GPUs from gloo ranks."""
    from workers.tools.launch import run_workers
    from workers.tools.parity import ParitySpec, _build, make_plan, make_tokens

    spec = ParitySpec(model="tiny-qwen2", lengths=(5, 17), cp_size=1, distribute="none",
                      model_kwargs=(("vocab_size", 128),))
    model = _build(spec)
    ids, labels = make_tokens(spec, 128)
    weights = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights)
    plan = make_plan(spec.lengths, 1, "none", model)
    total = sum(sum(1 for t in lab[1:] if t != IGNORE_INDEX) for lab in labels)
    (rank,) = run_workers(_rank_on_a_gpu_host, 1, args=(spec, str(weights), plan, ids, labels, total),
                          backend="gloo")
    assert rank["tokens"] == 22 and rank["grads"] and torch.isfinite(torch.tensor(rank["loss"]))
    # A gloo rank sees no GPU: DeepSpeed in one (test_lora, test_deepspeed_config) picks its CPU accelerator.
    assert rank["hidden"] == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
