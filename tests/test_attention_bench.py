"""`python -m app bench attention` runs end to end on tiny sizes (speed is reported, never asserted)."""

from __future__ import annotations

import json

import pytest

from app.__main__ import main


@pytest.mark.slow
def test_bench_attention_smoke(capsys) -> None:
    code = main(["bench", "attention", "--json", "--num-seqs", "6", "--max-len", "96", "--bimodal-scale",
                 "0.01", "--repeats", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert set(report["mixes"]) == {"long-tail", "bimodal"}
    for mix in report["mixes"].values():
        assert set(mix["ms"]) == {"dacp", "serialized", "static_cp"}
        assert all(v > 0 for v in mix["ms"].values())
