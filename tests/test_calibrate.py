"""scheduling.calibrate.fit_compute recovers a profile's mfu and launch cost, and `bench compute` runs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from app.__main__ import main
from scheduling import CostModel, HardwareProfile
from scheduling.calibrate import fit_compute


def test_fit_recovers_the_profile_that_generated_the_times() -> None:
    truth = dataclasses.replace(HardwareProfile(), mfu=0.31, micro_batch_launch_s=0.007)
    cost = CostModel.from_model_dims(hidden_size=896, kv_hidden_size=128, num_layers=24, profile=truth)
    flops = [sum(cost.flops(n) for n in lengths) for lengths in ([512] * 8, [4096], [16384], [2048] * 4)]
    seconds = [cost.t_comp(f) + truth.micro_batch_launch_s for f in flops]
    fit = fit_compute(flops, seconds, HardwareProfile())
    assert fit.mfu == pytest.approx(0.31, rel=1e-9)
    assert fit.micro_batch_launch_s == pytest.approx(0.007, rel=1e-6)
    assert fit.max_rel_residual < 1e-9
    assert fit.predict(flops[1]) == pytest.approx(seconds[1])


def test_fit_reports_nonlinearity_and_clips_a_negative_intercept() -> None:
    flops, seconds = np.array([1e12, 2e12, 3e12, 4e12]), np.array([0.9, 2.0, 2.9, 4.2])
    fit = fit_compute(flops, seconds, HardwareProfile())
    assert fit.intercept_s < 0 and fit.micro_batch_launch_s == 0.0
    # Reference: the line minimizing the squared *relative* residuals, (a*f + b - t) / t, solved directly.
    (a, b), *_ = np.linalg.lstsq(np.stack([flops / seconds, 1 / seconds], axis=1), np.ones(4), rcond=None)
    assert fit.slope_s_per_flop == pytest.approx(a) and fit.intercept_s == pytest.approx(b)
    assert fit.max_rel_residual == pytest.approx(np.max(np.abs(a * flops + b - seconds) / seconds))


@pytest.mark.parametrize("flops,seconds,match", [
    ([1e12], [1.0], "at least two"),
    ([1e12, 1e12], [1.0, 2.0], "different FLOPs"),
    ([1e12, 2e12], [1.0, 0.0], "positive times"),
    ([1e12, 2e12], [2.0, 1.0], "--max-tokens"),
])
def test_fit_rejects_unusable_measurements(flops, seconds, match) -> None:
    with pytest.raises(ValueError, match=match):
        fit_compute(flops, seconds, HardwareProfile())


@pytest.mark.slow
def test_bench_compute_smoke(capsys) -> None:
    # Large enough (4096 tokens, S^2 attention) that time grows with FLOPs well above timer noise.
    tiny = ["model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.intermediate_size=128", "model.vocab_size=256"]
    args = ["bench", "compute", "--config", "configs/tiny-cpu.yaml", "--device", "cpu",
            "--max-tokens", "4096", "--repeats", "1", "--json"]
    code = main(args + [x for item in tiny for x in ("--set", item)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert [r["tokens"] for r in report["rows"]] == [512] * 2 + [1024] * 3 + [2048] * 3 + [4096] * 2
    assert all(r["seconds_median"] > 0 and r["flops"] > 0 for r in report["rows"])
    assert report["fit"]["mfu"] > 0 and report["fit"]["max_rel_residual"] >= 0
    assert report["profile_values"]["mfu"] > 0
