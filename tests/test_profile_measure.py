"""The hardware-profile measurements (ring, gradient reduction, overlap, activation memory) and their fits.

The fits are checked on synthetic data with known parameters; the measurements run for real, on gloo
processes and a tiny random-init Qwen2 on CPU, and are checked for shape and direction only (never for
speed: this box's timings are whatever they are).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from scheduling.calibrate import fit_linear, fit_link
from workers.attention.comm import RingComm
from workers.models import build_model
from workers.tools.launch import run_workers
from workers.tools.profile_comm import (
    grad_reduce_buckets,
    lower_quartile,
    measure_grad_reduce,
    measure_overlap,
    measure_ring,
)
from workers.tools.profile_memory import activation_bytes_per_token, measure_activation_memory

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
"""Up to 16 MiB: its step takes tens of ms here, far above the jitter of a loaded 2-core box."""
GROUP = [1, 2]
"""The measured ranks of a 3-process world: rank 0 stays out, so a default-group call would hang."""


def test_fit_linear_recovers_a_line_under_both_weightings() -> None:
    x = [1.0, 2.0, 3.0, 5.0, 8.0]
    y = [3.0 * v + 2.0 for v in x]
    for relative in (False, True):
        fit = fit_linear(x, y, relative=relative)
        assert fit.slope == pytest.approx(3.0, rel=1e-9)
        assert fit.intercept == pytest.approx(2.0, rel=1e-9)
        assert fit.max_rel_residual < 1e-9
        assert fit.predict(10.0) == pytest.approx(32.0)


def test_fit_linear_reports_the_largest_relative_residual() -> None:
    fit = fit_linear([0.0, 1.0, 2.0], [1.0, 1.0, 4.0])
    # Least squares: slope 1.5, intercept 0.5 -> fits 0.5, 2.0, 3.5 -> relative residuals .5, 1, .125.
    assert (fit.slope, fit.intercept) == pytest.approx((1.5, 0.5))
    assert fit.max_rel_residual == pytest.approx(1.0)


@pytest.mark.parametrize("x,y,match", [
    ([1.0], [1.0], "two distinct"),
    ([2.0, 2.0, 2.0], [1.0, 2.0, 3.0], "two distinct"),
    ([1.0, 2.0], [1.0, 0.0], "positive y"),
    ([1.0, 2.0], [1.0, -3.0], "positive y"),
    ([1.0, 2.0, 3.0], [1.0, 2.0], "same length"),
])
def test_fit_linear_rejects_degenerate_input(x, y, match) -> None:
    with pytest.raises(ValueError, match=match):
        fit_linear(x, y)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    sizes = [4096.0 * 4**i for i in range(7)]
    fit = fit_link(sizes, [20e-6 + b / 5e9 for b in sizes])
    assert fit.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(5e9, rel=1e-9)
    assert fit.max_rel_residual < 1e-6
    assert fit.predict(1e9) == pytest.approx(20e-6 + 0.2)


def test_fit_link_clips_a_negative_latency_and_rejects_a_flat_link() -> None:
    sizes = [1e6, 2e6, 4e6]
    fit = fit_link(sizes, [b / 1e9 - 1e-4 for b in sizes])
    assert fit.latency_s == 0.0 and fit.bandwidth == pytest.approx(1e9)
    assert fit.max_rel_residual == pytest.approx(1e-4 / (1e-3 - 1e-4))  # the clipped model's, at 1 MB
    with pytest.raises(ValueError, match="larger sizes"):
        fit_link(sizes, [3e-3, 2e-3, 1e-3])


def test_grad_reduce_buckets_cut_like_deepspeed_buckets() -> None:
    assert grad_reduce_buckets(10, 4) == [4, 4, 2]
    assert grad_reduce_buckets(8, 4) == [4, 4]
    assert grad_reduce_buckets(3, 500) == [3]
    with pytest.raises(ValueError, match="must be >= 1"):
        grad_reduce_buckets(0, 4)


def test_lower_quartile_is_the_nearest_rank_25th_percentile() -> None:
    assert lower_quartile([5.0]) == 5.0
    assert lower_quartile([4.0, 1.0, 3.0, 2.0]) == 1.0  # fewer than five: the smallest
    assert lower_quartile([float(v) for v in range(50, 0, -1)]) == 13.0  # the 13th of 50
    with pytest.raises(ValueError, match="at least one"):
        lower_quartile([])


def test_measurements_reject_zero_repeats() -> None:
    # Checked before any communication, so no process group is needed.
    with pytest.raises(ValueError, match="repeats"):
        measure_ring(None, [1024], repeats=0, device=torch.device("cpu"))  # type: ignore[arg-type]


def _comm_worker(rank: int, world_size: int, sizes: list[int]) -> dict | None:
    group = dist.new_group(GROUP)  # collective over the world: every rank creates it
    result = None
    if rank in GROUP:
        comm = RingComm(group)
        cpu = torch.device("cpu")
        a = torch.randn(256, 256)

        def compute() -> None:
            for _ in range(8):
                a @ a

        result = {
            "ring": measure_ring(comm, sizes, repeats=3, device=cpu),
            "grad": measure_grad_reduce(1_200_000, group, dtype=torch.float32, repeats=3, device=cpu,
                                        bucket_elements=500_000),
            "overlap": measure_overlap(comm, 1 << 20, compute, repeats=3, device=cpu),
        }
    # Rank 0 waits here from the start: if a measurement used the default group, its peers would
    # block in that collective and this barrier would time out with an error instead of hanging.
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    return result


@pytest.mark.slow
def test_comm_measurements_over_a_subgroup() -> None:
    outside, *members = run_workers(_comm_worker, 3, args=(SIZES,), backend="gloo")
    assert outside is None
    ring, grad, overlap = (members[0][k] for k in ("ring", "grad", "overlap"))
    # Every time is the maximum over the group's ranks, so both members report the same numbers.
    assert members[0] == members[1]

    assert [row["bytes"] for row in ring] == SIZES
    assert all(0 < row["seconds_min"] <= row["seconds_p25"] <= row["seconds_median"] for row in ring)
    assert ring[-1]["seconds_median"] > ring[0]["seconds_median"]
    link = fit_link([row["bytes"] for row in ring], [row["seconds_median"] for row in ring])
    assert link.bandwidth > 0 and link.latency_s >= 0

    assert grad["collective"] == "all_reduce" and grad["buckets"] == 3
    assert grad["params"] == 1_200_000 and grad["bytes"] == 4 * 1_200_000
    assert grad["seconds_median"] > 0

    assert 0.0 <= overlap["overlap"] <= 1.0
    assert min(overlap["comm_s"], overlap["compute_s"]) > 0
    assert overlap["both_s"] >= 0.5 * max(overlap["comm_s"], overlap["compute_s"])


def test_activation_memory_grows_with_tokens() -> None:
    pytest.importorskip("psutil")  # the CPU path samples RSS with it
    model = build_model("tiny-qwen2", hidden_size=128, intermediate_size=256, num_layers=2, seed=0)
    model.train()
    cases = [(256,), (256,) * 4, (256,) * 16]
    rows = measure_activation_memory(model, cases, device=torch.device("cpu"), loss_chunk_tokens=1024)
    assert [row["tokens"] for row in rows] == [256, 1024, 4096]
    assert [row["lengths"] for row in rows] == [list(c) for c in cases]
    assert rows[-1]["peak_bytes"] > rows[0]["peak_bytes"] > 0
    fit = activation_bytes_per_token(rows)
    # hidden 128 in fp32: each layer alone keeps several hidden-sized tensors per token (512 B each).
    assert fit.slope > 512
    assert all(p.grad is None for p in model.parameters())  # left as found: no gradients held
