"""`python -m app verify`: the user-facing parity check (tiny Qwen2, CP=2 over gloo)."""

from __future__ import annotations

import json

import pytest

from app.__main__ import main


@pytest.mark.slow
def test_verify_json_all_distributed(capsys) -> None:
    code = main(["verify", "--cp", "2", "--model", "tiny-qwen2", "--lengths", "1,2,30,64",
                 "--distribute", "all", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, out
    assert {"loss_abs_diff", "grad_max_abs_diff", "grad_max_rel_diff", "tolerance", "ok"} <= set(out)
    assert out["ok"] is True and out["tolerance"] == 1e-5
    assert out["plan"] == {"local": [[], []], "distributed": [0, 1, 2, 3]}
    assert out["grad_max_rel_diff"] <= 1e-5


def test_verify_rejects_bad_lengths(capsys) -> None:
    assert main(["verify", "--lengths", "3,x"]) == 2
    assert "--lengths" in capsys.readouterr().err
    assert main(["verify", "--lengths", "0,4"]) == 2
