"""`python -m app bench step` (app/bench/step.py, workers/tools/step_bench.py) on the tiny CPU config: its
--json line has the fields the command promises, the variants train the same global batches (equal losses
where the math is equal), a variant that changes BucketSize plans its own micro-batches, and --trace writes
a Chrome trace per variant with the top ops by self time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.bench.step import parse_variant
from app.config import ConfigError

TINY = ["--config", "configs/tiny-cpu.yaml", "--set", "data.tokenizer=configs/bench/synth-bpe-773.json",
        "--set", "data.length_scale=0.1", "--set", "scheduling.global_batch_size=8"]


def test_a_variant_is_a_name_and_overrides() -> None:
    variant = parse_variant("fast:train.optimizer_impl=fused,train.adam_betas=[0.9,0.99],model.kernels=torch")
    assert variant.name == "fast"
    assert variant.overrides == ("train.optimizer_impl=fused", "train.adam_betas=[0.9,0.99]",
                                 "model.kernels=torch")
    for bad in ("fast", "fast:", ":train.compile=true", "fast:train.compile"):
        with pytest.raises(ConfigError, match="--variant"):
            parse_variant(bad)


def _bench_step(rank: int, world: int, argv: list[str], broken: str = "",
                stop_after: int = 0) -> tuple[int, dict]:
    """`python -m app bench step ARGV --json` in a rank of its own (DeepSpeed keeps process-wide group state
    between engines: a process per run, as the command is); `broken`: a variant whose engine build raises;
    `stop_after`: --max-seconds counts as reached once that many steps were timed (a clock the test owns)."""
    import contextlib
    import io

    import workers.tools.step_bench as step_bench
    from app.__main__ import main

    build = step_bench._build

    def failing(variant, device, seed):
        if variant.name == broken:
            raise RuntimeError("no such kernel here")
        return build(variant, device, seed)

    step_bench._build = failing
    if stop_after:
        timed, step = [], step_bench._timed_step
        step_bench._timed_step = lambda *args: timed.append(1) or step(*args)
        step_bench._Budget.spent = lambda self: self.max_seconds is not None and len(timed) >= stop_after
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "step", *TINY, *argv, "--json"])
    return code, json.loads(out.getvalue().strip().splitlines()[-1])


def test_bench_step_json_on_the_tiny_config(tmp_path: Path) -> None:
    from workers.tools.launch import run_workers

    ((code, result),) = run_workers(_bench_step, 1, args=(
        ["--variant", "today:train.optimizer_impl=foreach",
         "--variant", "fused:train.optimizer_impl=fused,scheduling.bucket_size=256",
         "--steps", "2", "--trace", str(tmp_path / "trace")],), backend="gloo")
    assert code == 0
    assert result["device"].endswith("threads") and result["steps"] == 2 and result["warmup_steps"] == 1
    assert result["stopped_early"] is None
    assert set(result["variants"]) == set(result["speedup_vs_first"]) == {"today", "fused"}
    assert result["speedup_vs_first"]["today"] == 1.0 and result["speedup_vs_first"]["fused"] > 0
    for name, variant in result["variants"].items():
        for key in ("tokens_per_s", "mfu", "micro_batch_s", "optimizer_s", "gap_s", "predicted_peak_bytes"):
            assert variant[key] > 0 or (key == "gap_s" and variant[key] >= 0), (name, key)
        assert variant["peak_bytes"] is None  # no device allocator on CPU
        assert len(variant["losses"]) == 3 and all(variant["applied"])
        assert (tmp_path / "trace" / f"{name}.json").stat().st_size > 0
        assert len(variant["top_ops"]) == 15 and variant["top_ops"][0]["self_ms"] > 0
        assert "device_time" not in variant  # CPU: no device timeline
        phases = variant["engine_phases_s"]  # the engine build's split (workers/engine.py engine_phases)
        assert list(phases)[:2] == ["import", "model"] and list(phases)[-2:] == ["deepspeed", "other"]
        assert all(v >= 0 for v in phases.values()) and phases["model"] > 0 and phases["deepspeed"] > 0
    today, fused = result["variants"]["today"], result["variants"]["fused"]
    assert today["bucket_size"] == 1024 and fused["bucket_size"] == 256
    # the model's peak is taken at the largest micro-batch each ran (the measured peak is the steps')
    assert 0 < fused["peak_tokens"] <= 256 < today["peak_tokens"] <= 1024
    assert fused["predicted_peak_bytes"] < today["predicted_peak_bytes"]
    assert fused["micro_batches"] > today["micro_batches"]  # a smaller C: more micro-batches, same rows
    # The same global batches from the same weights: micro-batching and the optimizer's implementation change
    # the order of sums, not the math (fp32).
    assert fused["losses"] == pytest.approx(today["losses"], rel=1e-5)


def test_a_variant_that_fails_leaves_the_others_measured_and_a_time_box_reports_what_it_measured() -> None:
    """One variant that cannot run (here its engine build raises, as a kernel the machine lacks would) is
    reported with its error and the command exits 1; the other variants are still measured. A run that
    reaches --max-seconds (here after the warm-up step and one counted step of 3) reports the step it
    counted, says it stopped early, and exits 1."""
    from workers.tools.launch import run_workers

    ((code, result),) = run_workers(_bench_step, 1, args=(
        ["--variant", "ok:train.optimizer_impl=fused", "--variant", "broken:train.optimizer_impl=foreach",
         "--steps", "3", "--max-seconds", "3600"], "broken", 2), backend="gloo")
    assert code == 1
    assert result["variants"]["broken"]["error"] == "RuntimeError: no such kernel here"
    ok = result["variants"]["ok"]
    assert ok["tokens_per_s"] > 0 and ok["counted_steps"] == 1 and len(ok["losses"]) == 2
    assert result["stopped_early"] == "--max-seconds 3600 reached"
    assert result["speedup_vs_first"] == {"ok": 1.0, "broken": None}


def test_the_traced_device_time_is_the_union_of_its_kernels() -> None:
    """`device_time` (bench step --trace on CUDA): overlapping and nested intervals count once, the gaps
    between them are idle (microseconds in, milliseconds out)."""
    from workers.tools.step_bench import device_time

    timeline = [(0.0, 1000.0), (500.0, 1500.0), (600.0, 700.0), (3000.0, 4000.0), (1500.0, 2000.0)]
    assert device_time(timeline) == {"span_ms": 4.0, "busy_ms": 3.0, "idle_ms": 1.0}
    assert device_time([(10.0, 20.0)]) == {"span_ms": 0.01, "busy_ms": 0.01, "idle_ms": 0.0}
