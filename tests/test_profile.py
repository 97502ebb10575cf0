"""`python -m app profile`: the fits recover the profile that generated the measurements, and the command
measures this machine (2 gloo ranks) and writes a profile that `plan` and `train` load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from app.__main__ import main
from app.commands.profile import compute_cases, fit_profile
from app.config import load_config
from app.hardware import cost_model, load_hardware_profile

TRUTH = {"mfu": 0.2, "micro_batch_launch_s": 0.004, "intra_node_latency_s": 1e-4,
         "intra_node_bandwidth": 2e9, "ring_overlap": 0.6, "grad_reduce_bandwidth": 1e9,
         "optimizer_s_per_param": 2e-8, "activation_bytes_per_hidden": 300.0}
TINY = ["scheduling.cost_formula=model", "model.vocab_size=773"]


def _raw(config) -> dict:
    """What profile_rank would return on a machine that behaves exactly like TRUTH."""
    cost = cost_model(config)
    truth = dataclasses.replace(cost, profile=dataclasses.replace(cost.profile, **{
        k: v for k, v in TRUTH.items() if k != "ring_overlap"}))
    world, params = 2, 1_000_000
    reduce_bytes = params * 4
    reduce_s = 2 * (world - 1) / world * reduce_bytes / TRUTH["grad_reduce_bandwidth"]
    per_token = TRUTH["activation_bytes_per_hidden"] * cost.num_layers * cost.hidden_size
    compute = []
    for lengths, fraction in compute_cases(512):
        labels = [max(1, round(n * fraction)) - 1 for n in lengths]
        flops = sum(truth.flops(n, lab) for n, lab in zip(lengths, labels, strict=True))
        compute.append({"lengths": list(lengths), "labels": labels, "tokens": sum(lengths),
                        # timed through the engine: the reduction is part of every micro-batch
                        "seconds_median": truth.t_comp(flops) + TRUTH["micro_batch_launch_s"] + reduce_s})
    # the cost model's ring step: max(latency, bytes / bandwidth), latency-bound up to 200 KB here
    ring = [{"bytes": b, "seconds_min": max(TRUTH["intra_node_latency_s"], b / TRUTH["intra_node_bandwidth"])}
            for b in (4096, 65536, 1 << 20, 1 << 24)]
    return {
        "world_size": world, "cp_size": 2, "params": params, "device": "test cpu", "compute": compute,
        "ring": ring, "overlap": {"overlap": TRUTH["ring_overlap"]},
        "reduce": {"params": params, "bytes": reduce_bytes, "seconds_median": reduce_s},
        "optimizer": {"params": params, "seconds_median": TRUTH["optimizer_s_per_param"] * params / world},
        "memory": [{"tokens": t, "peak_bytes": 1e6 + t * per_token} for t in (64, 128, 256, 512)],
    }


def test_the_fits_recover_the_machine_that_made_the_measurements() -> None:
    config = load_config("configs/tiny-cpu.yaml", TINY)
    fields, residuals = fit_profile(config, _raw(config))
    for key, value in TRUTH.items():
        assert fields[key] == pytest.approx(value, rel=1e-6), key
    assert fields["grad_reduce_passes"] == 2.0
    assert max(residuals.values()) < 1e-6


def test_profile_measures_this_machine_and_writes_a_loadable_profile(tmp_path: Path, capsys) -> None:
    out = tmp_path / "measured.yaml"
    sets = [part for s in TINY for part in ("--set", s)]
    assert main(["profile", "--config", "configs/tiny-cpu.yaml", *sets, "--max-tokens", "1024",
                 "--repeats", "1", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["residuals"]) == {"compute", "ring", "memory"}
    raw = result["raw"]
    assert len(raw["ring"]) == 7 and raw["overlap"]["both_s"] > 0 and raw["optimizer"]["seconds_median"] > 0
    profile = load_hardware_profile(str(out))
    assert profile.name == "measured"
    for key in ("mfu", "intra_node_bandwidth", "ring_overlap", "optimizer_s_per_param"):
        assert getattr(profile, key) == pytest.approx(result["profile"][key], rel=1e-5), key
    assert "# Measured by `python -m app profile" in out.read_text()
    # the profile drives a plan like any other
    assert main(["plan", "--config", "configs/tiny-cpu.yaml", *sets, "--set", f"hardware.profile={out}",
                 "--set", "plan.num_batches=1", "--json"]) == 0
