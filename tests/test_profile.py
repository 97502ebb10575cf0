"""`python -m app profile`: the fits recover the profile that generated the measurements, and the command
measures this machine (2 gloo ranks) and writes a profile that `plan` and `train` load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from app.__main__ import main
from app.commands.profile import _bucket_size, compute_cases, fit_profile, profile_yaml
from app.config import load_config
from app.profiling.activation import Checkpointing, kernel_set, model_shape, pass_memory
from app.profiling.budget import resolve_bucket_size
from app.profiling.hardware import cost_model, load_hardware_profile
from app.profiling.steps import STEP_POLICIES, fitted_cost, planned_steps, scaled_fields
from scheduling import simulate
from scheduling.calibrate import fit_step_scale, fit_two_regime
from tests.run_configs import SMALL_VOCAB

TRUTH = {"mfu": 0.2, "micro_batch_launch_s": 0.004, "intra_node_latency_s": 1e-4,
         "intra_node_comm_offset_s": 2e-5, "intra_node_bandwidth": 2e9, "ring_overlap": 0.6,
         "grad_reduce_bandwidth": 1e9,
         "optimizer_s_per_param": 2e-8, "runtime_memory_bytes": 3e6}
TINY = ["scheduling.cost_formula=model", "model.vocab_size=773", SMALL_VOCAB]
"""A 773-word model with its 773-word tokenizer (`plan` refuses a tokenizer whose ids the model cannot
embed)."""

QWEN05_SHAPE = ["model.name_or_path=tiny-qwen2", "model.random_init=true", "model.hidden_size=896",
                "model.num_layers=24", "model.num_attention_heads=14", "model.num_key_value_heads=2",
                "model.intermediate_size=4864", "model.vocab_size=151936", "data.source=synthetic",
                "scheduling.bucket_size=16384"]
"""scripts/gpu_check.sh's profile of Qwen2.5-0.5B's shape (random weights, synthetic data)."""


def _raw(config) -> dict:
    """What profile_rank would return on a machine that behaves exactly like TRUTH."""
    cost = cost_model(config)
    truth = fitted_cost(cost, {k: v for k, v in TRUTH.items() if k != "ring_overlap"})
    world, params = 2, 1_000_000
    reduce_bytes = params * 4
    reduce_s = 2 * (world - 1) / world * reduce_bytes / TRUTH["grad_reduce_bandwidth"]
    # the shape-derived model of each pass (app/profiling/activation/) plus the runtime bytes it misses
    shape, chunk = model_shape(config), config.train.loss_chunk_tokens

    def modeled(every: int, tokens: int) -> float:  # a pass under one loss chunk holds its rows only
        return pass_memory(shape, kernel_set("torch"), Checkpointing(every), min(chunk, tokens)).peak(tokens)

    compute = []
    for lengths, fraction in compute_cases(512):
        labels = [max(1, round(n * fraction)) - 1 for n in lengths]
        flops = sum(truth.flops(n, lab) for n, lab in zip(lengths, labels, strict=True))
        compute.append({"lengths": list(lengths), "labels": labels, "tokens": sum(lengths),
                        # timed through the engine: the reduction is part of every micro-batch
                        "seconds_median": truth.t_comp(flops) + TRUTH["micro_batch_launch_s"] + reduce_s})
    # the cost model's ring step: max(latency, offset + bytes / bandwidth), latency-bound up to 160 KB here
    sizes = (4096, 65536, 1 << 20, 1 << 24)
    ring = [{"bytes": b, "seconds_p25": truth.profile.ring_step_s(b, 2)} for b in sizes]
    return {
        "world_size": world, "cp_size": 2, "params": params, "device": "test cpu", "compute": compute,
        "ring": ring, "overlap": {"overlap": TRUTH["ring_overlap"]},
        "reduce": {"params": params, "bytes": reduce_bytes, "seconds_median": reduce_s},
        "optimizer": {"params": params, "seconds_median": TRUTH["optimizer_s_per_param"] * params / world},
        "memory": [{"tokens": t, "peak_bytes": modeled(0, t) + TRUTH["runtime_memory_bytes"]}
                   for t in (64, 128, 256, 512)],
        # every layer recomputed: each keeps its input, one layer's activations live at a time; the
        # largest case exceeds its model the most
        "memory_checkpointed": [{"tokens": t,
                                 "peak_bytes": modeled(1, t) + TRUTH["runtime_memory_bytes"] * t / 512}
                                for t in (64, 128, 256, 512)],
    }


def test_the_fits_recover_the_machine_that_made_the_measurements() -> None:
    config = load_config("configs/tiny-cpu.yaml", TINY)
    fields, residuals = fit_profile(config, _raw(config))
    for key, value in TRUTH.items():
        assert fields[key] == pytest.approx(value, rel=1e-6), key
    assert fields["grad_reduce_passes"] == 2.0
    # the checkpointed rows' slope is off the model's by the runtime bytes spread over 512 tokens
    assert residuals.pop("memory_checkpointed") > 0
    assert max(residuals.values()) < 1e-6


def test_a_measured_device_memory_replaces_the_base_profiles_and_sizes_the_bucket() -> None:
    """On CUDA the workers report what the device's allocator can hold (an H200: 150 GB against the h100
    base profile's 80 GB): the profile carries it, marked measured, and `auto` sizes C from it; on CPU
    (no report) the base profile's value stays, unmarked."""
    # resolved as `profile` resolves it
    config, _ = resolve_bucket_size(load_config("configs/qwen2.5-0.5b-gpu.yaml", QWEN05_SHAPE))
    cpu_raw = _raw(config)
    base_fields, residuals = fit_profile(config, cpu_raw)
    assert "device_memory_bytes" not in base_fields
    gpu_raw = {**cpu_raw, "device_memory_bytes": 150.0e9}
    fields, _ = fit_profile(config, gpu_raw)
    assert fields["device_memory_bytes"] == 150.0e9
    assert {k: v for k, v in fields.items() if k != "device_memory_bytes"} == base_fields
    text = profile_yaml(config, gpu_raw, fields, residuals, "h200", "python -m app profile")
    assert "device_memory_bytes: 1.5e+11  # measured" in text.splitlines()
    base_text = profile_yaml(config, cpu_raw, base_fields, residuals, "h100", "python -m app profile")
    assert "device_memory_bytes: 8e+10" in base_text.splitlines()
    # C = (M - safety - static - runtime - fixed) / per-token bytes: 70 GB more of M, 90% of it usable
    base_c, c = _bucket_size(config, base_fields), _bucket_size(config, fields)
    assert c > base_c > 0
    per_token = 0.9 * 70e9 / (c - base_c)
    assert 0.2e6 < per_token < 2e6  # the 0.5B's activation bytes per token (docs/memory.md: ~1 MB)


def test_whole_steps_slower_than_their_parts_scale_every_time_term() -> None:
    config = load_config("configs/tiny-cpu.yaml", TINY)
    raw = _raw(config)
    isolated, _ = fit_profile(config, raw)
    steps = planned_steps(config, cost_model(config), num_batches=2, world_size=2)
    assert [s.policy for s in steps] == list(STEP_POLICIES) * 2
    truth = fitted_cost(cost_model(config), isolated)
    raw["steps"] = [1.3 * simulate(s.plan, s.lengths, truth, labels=s.labels).total_s for s in steps]
    fields, residuals = fit_profile(config, raw, steps)
    assert raw["step_fit"]["scale"] == pytest.approx(1.3, rel=1e-9)
    assert raw["step_fit"]["max_rel_residual_before"] == pytest.approx(0.3 / 1.3, rel=1e-9)
    assert residuals["step"] < 1e-9
    assert fields["mfu"] == pytest.approx(TRUTH["mfu"] / 1.3, rel=1e-6)
    assert fields["micro_batch_launch_s"] == pytest.approx(TRUTH["micro_batch_launch_s"] * 1.3, rel=1e-6)
    assert fields["ring_overlap"] == TRUTH["ring_overlap"]  # a share, not a time


def test_whole_steps_fit_what_a_sharded_sequence_costs() -> None:
    """The steps' micro-batch laps (each the max over the CP ranks of a machine that charges 2 ms per
    sharded sequence, ring step and layer) give ring_sequence_step_s back (scheduling/refit.py's fit)."""
    config = load_config("configs/tiny-cpu.yaml", TINY)
    raw = _raw(config)
    isolated, _ = fit_profile(config, raw)
    steps = planned_steps(config, cost_model(config), num_batches=2, world_size=2)
    truth = fitted_cost(cost_model(config), isolated | {"ring_sequence_step_s": 2e-3})
    raw["steps"] = [simulate(s.plan, s.lengths, truth, labels=s.labels).total_s for s in steps]
    raw["step_laps"] = [_laps(s, truth) for s in steps]
    fields, _ = fit_profile(config, raw, steps)
    assert fields["ring_sequence_step_s"] == pytest.approx(2e-3, rel=0.05)
    assert raw["sequence_fit"]["micro_batches"] == sum(s.plan.num_micro_batches for s in steps)


def _laps(step, cost) -> dict:
    """What the workers lap of `step` on the machine `cost` models: each micro-batch's slowest CP rank."""
    from scheduling.cost import SubgroupClock
    from scheduling.simulate import plan_times

    flops = cost.sequence_flops(step.lengths, step.labels)
    kv = [cost.kv_bytes(float(n)) for n in step.lengths]
    clock = SubgroupClock(cost, step.plan.cp_size, step.plan.dp_size * step.plan.cp_size)
    return {"micro_batch_s": [max(plan_times(mb, flops, kv, clock)) for mb in step.plan.micro_batches[0]],
            "optimizer_s": cost.optimizer_step_s(step.plan.dp_size * step.plan.cp_size)}


@pytest.mark.parametrize("gpus_per_node", [8, 1], ids=["ring-in-a-node", "ring-across-nodes"])
@pytest.mark.parametrize("scale", [0.5, 1.7])
def test_scaling_every_time_term_scales_every_modeled_step_exactly(scale: float, gpus_per_node: int) -> None:
    # fit_step_scale's premise: the cost model is homogeneous of degree 1 in time. Every field of the
    # profile goes through scaled_fields, so a time or rate field that is not marked as one fails here.
    config = load_config("configs/tiny-cpu.yaml", TINY)
    every = dataclasses.asdict(fitted_cost(cost_model(config), TRUTH).profile)
    every |= {"gpus_per_node": gpus_per_node, "inter_node_comm_offset_s": 3e-5}
    del every["name"]
    base = fitted_cost(cost_model(config), every)
    scaled = fitted_cost(cost_model(config), scaled_fields(every, scale))
    for step in planned_steps(config, base, num_batches=2, world_size=2):
        a = simulate(step.plan, step.lengths, base, labels=step.labels)
        b = simulate(step.plan, step.lengths, scaled, labels=step.labels)
        assert b.total_s == pytest.approx(scale * a.total_s, rel=1e-9)
        assert b.rank_busy_s[0] == pytest.approx(tuple(scale * t for t in a.rank_busy_s[0]), rel=1e-9)


def test_fit_step_scale_minimizes_the_relative_error() -> None:
    predicted, measured = [1.0, 2.0, 4.0], [1.2, 2.6, 4.4]
    fit = fit_step_scale(predicted, measured)
    pairs = list(zip(predicted, measured, strict=True))
    grid = [1.0 + i * 1e-4 for i in range(5000)]  # brute force over k in [1, 1.5)
    best = min(grid, key=lambda k: sum((k * p / m - 1) ** 2 for p, m in pairs))
    assert fit.scale == pytest.approx(best, abs=1e-4)
    assert fit.max_rel_residual == pytest.approx(max(abs(fit.scale * p / m - 1) for p, m in pairs))
    with pytest.raises(ValueError, match="positive"):
        fit_step_scale([1.0], [0.0])


@pytest.mark.slow  # a Ray Train worker group
def test_profile_measures_this_machine_and_writes_a_loadable_profile(tmp_path: Path, capsys) -> None:
    out = tmp_path / "measured.yaml"
    sets = [part for s in TINY for part in ("--set", s)]
    assert main(["profile", "--config", "configs/tiny-cpu.yaml", *sets, "--max-tokens", "1024",
                 "--repeats", "1", "--steps", "1", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # memory per checkpointing setting: nothing and every layer recomputed (offload on CUDA only)
    assert set(result["residuals"]) == {"compute", "ring", "memory", "memory_checkpointed", "step"}
    raw = result["raw"]
    assert result["profile"]["runtime_memory_bytes"] >= 0 and len(raw["memory_checkpointed"]) == 4
    assert "device_memory_bytes" not in raw  # CPU workers share the host: the base profile's value stays
    assert len(raw["steps"]) == len(STEP_POLICIES) and min(raw["steps"]) > 0
    assert raw["step_fit"]["scale"] > 0 and raw["sequence_fit"]["micro_batches"] > 0
    sizes = [row["bytes"] for row in raw["ring"]]
    assert len(sizes) >= 3 and sizes == sorted(set(sizes))
    assert raw["overlap"]["both_s"] > 0 and raw["optimizer"]["seconds_median"] > 0
    profile = load_hardware_profile(str(out))
    assert profile.name == "measured"
    for key in ("mfu", "intra_node_bandwidth", "ring_overlap", "optimizer_s_per_param"):
        assert getattr(profile, key) == pytest.approx(result["profile"][key], rel=1e-5), key
    assert "# Measured by `python -m app profile" in out.read_text()
    assert "whole training steps ran" in out.read_text()
    # the profile drives a plan like any other
    assert main(["plan", "--config", "configs/tiny-cpu.yaml", *sets, "--set", f"hardware.profile={out}",
                 "--set", "plan.num_batches=1", "--json"]) == 0


def test_fit_two_regime_recovers_the_ring_step_form_and_predicts_with_it() -> None:
    sizes = [4096, 65536, 1 << 20, 1 << 24]
    seconds = [max(1e-4, b / 2e9) for b in sizes]
    link = fit_two_regime(sizes, seconds)
    assert link.two_regime and link.max_rel_residual < 1e-9
    assert link.latency_s == pytest.approx(1e-4) and link.bandwidth == pytest.approx(2e9)
    assert [link.predict(b) for b in sizes] == pytest.approx(seconds)


def test_fit_two_regime_fits_a_link_that_is_no_ideal_pipe_with_the_papers_offset() -> None:
    # Fastest-of-50 gloo P2P times measured on this 2-core machine (docs/benchmarks.md): flat up to 64 KiB,
    # then growing faster than an ideal pipe would. max(latency, bytes / bandwidth) cannot fit them within
    # 15% (the best latency splits 92 us and 128 us: 16.4% off both); the paper's a_c*V + b_c line can.
    sizes, seconds = [4096, 65536, 262144, 1 << 20], [92e-6, 92e-6, 128e-6, 339e-6]
    assert fit_two_regime(sizes, seconds, through_origin=True).max_rel_residual == pytest.approx(
        (128 - 2 * 92 * 128 / (92 + 128)) / 128)
    link = fit_two_regime(sizes, seconds)
    assert link.max_rel_residual < 1e-9 and link.offset_s > 0
    assert [link.predict(b) for b in sizes] == pytest.approx(seconds)


def test_a_fitted_launch_cost_of_zero_is_a_valid_profile() -> None:
    # profile clips a negative launch (intercept below the measured reduction) to 0: loadable, not an error
    config = load_config("configs/tiny-cpu.yaml", TINY)
    cost = fitted_cost(cost_model(config), {**TRUTH, "micro_batch_launch_s": 0.0})
    assert cost.micro_batch_overhead_s(1) == 0.0
    with pytest.raises(ValueError, match="micro_batch_launch_s"):
        fitted_cost(cost_model(config), {"micro_batch_launch_s": -1e-3})
