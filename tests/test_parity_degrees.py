"""`python -m app verify --degrees`: a tiny HF model's loss and gradients over CP = 4 gloo ranks, with one
micro-batch holding local sequences (degree 1), sequences sharded over aligned subgroups of 2 ranks and
over all 4 (lengths not multiples of 2d), against the unsharded model's own forward/backward (fp32 1e-5,
workers/tools/parity.py). The plan it builds (plan_with_degrees) and its argument errors are checked in
this process."""

from __future__ import annotations

import json

import pytest

from app.__main__ import main
from workers.tools.parity import plan_with_degrees

LENGTHS = "3,45,17,90,7,55,2,31"


@pytest.mark.slow  # CP = 4 processes, like the CP = 2 runs of tests/test_verify.py
def test_verify_with_degrees_1_2_4_matches_the_unsharded_model(capsys) -> None:
    code = main(["verify", "--cp", "4", "--model", "tiny-qwen2", "--lengths", LENGTHS, "--degrees", "1,2,4",
                 "--backend", "gloo", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["ok"] is True, out
    plan = out["plan"]
    assert plan["distributed"] and any(plan["local"]) and {e["degree"] for e in plan["partial"]} == {2}
    assert out["degrees"] == [1, 2, 4] and out["tolerance"] == 1e-5
    assert out["grad_max_rel_diff"] <= 1e-5 and out["loss_abs_diff"] <= 1e-5
    print(f"loss abs diff {out['loss_abs_diff']:.2e}, grad max rel diff {out['grad_max_rel_diff']:.2e}, "
          f"grad max abs diff {out['grad_max_abs_diff']:.2e}, plan {plan}, tokens {out['rank_tokens']}")


def test_plan_with_degrees_uses_each_degree_longest_on_most_ranks() -> None:
    lengths = tuple(int(x) for x in LENGTHS.split(","))
    plan = plan_with_degrees(lengths, 4, (1, 2, 4))
    degrees = {i: plan.degree_of(i) for i in range(len(lengths))}
    assert set(degrees.values()) == {1, 2, 4} and sorted(plan.indices) == list(range(len(lengths)))
    # Longest first: each degree's sequences are no shorter than those of every lower degree.
    for a in range(len(lengths)):
        for b in range(len(lengths)):
            if degrees[a] > degrees[b]:
                assert lengths[a] >= lengths[b]
    assert plan_with_degrees((5, 9), 4, (2,)).partial[0].indices == (1,)  # balanced over the two groups
    assert plan_with_degrees((5, 9), 1, (1,)).local == ((1, 0),)


@pytest.mark.parametrize("argv,message", [
    (["--degrees", "1,3"], "each must divide --cp 4"),
    (["--degrees", "1,2,2"], "without repeats"),
    (["--degrees", "1,x"], "expected comma-separated integers"),
    (["--degrees", "1,2", "--distribute", "all"], "drop --distribute"),
    (["--degrees", "1,2,4", "--lengths", "3,9"], "at least one sequence per degree"),
])
def test_verify_refuses_bad_degrees(capsys, argv, message) -> None:
    lengths = [] if "--lengths" in argv else ["--lengths", "3,9,40"]
    assert main(["verify", "--cp", "4", "--backend", "gloo", *lengths, *argv]) == 2
    assert message in capsys.readouterr().err
