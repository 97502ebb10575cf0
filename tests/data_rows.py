"""Example rows in every on-disk format, shared by the reader tests and the Ray Data pipeline tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.data.ray_ops import MESSAGES_TYPE
from app.data.synth import ConversationSynth, synth_conversations
from app.data.tokenizer import load_tokenizer

NUM_GOOD = 24
# Rows every format can hold (parquet/hf have typed columns, so no wrong-type rows there).
BAD_ROWS = [
    {"messages": [], "text": None},                                          # empty
    {"messages": None, "text": "a plain text row"},                          # ok, text
    {"messages": None, "text": None},                                        # malformed
    {"messages": [{"role": None, "content": "x"}], "text": None},            # malformed
]
BAD_STATUSES = ["empty", "ok", "malformed", "malformed"]


def example_rows() -> list[dict]:
    """NUM_GOOD synthetic chats (lengths 30..260 tokens), with the bad rows spliced in after row 5."""
    synth = ConversationSynth(load_tokenizer("qwen"))
    targets = np.linspace(30, 260, NUM_GOOD).astype(np.int64)
    good = [{"messages": c, "text": None} for c in synth_conversations(
        synth, np.arange(NUM_GOOD), targets, "lmsys", seed=7)]
    return good[:5] + BAD_ROWS + good[5:]


def write_all_formats(root: Path, rows: list[dict]) -> dict[str, Path]:
    """The same rows as a 2-file parquet dir, a .jsonl file (plus junk lines) and a HF save_to_disk dir."""
    import datasets

    table = pa.table({"messages": pa.array([r["messages"] for r in rows], MESSAGES_TYPE),
                      "text": pa.array([r["text"] for r in rows], pa.string())})
    parquet_dir = root / "parquet"
    parquet_dir.mkdir()
    half = len(rows) // 2  # file names sort in row order: part-0 then part-1
    pq.write_table(table.slice(0, half), parquet_dir / "part-0.parquet")
    pq.write_table(table.slice(half), parquet_dir / "part-1.parquet")
    jsonl = root / "rows.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "")                         # blank lines are skipped, not counted
    lines.append('{"messages": "oops"')         # truncated JSON -> malformed
    lines.append('{"messages": "a string"}')    # wrong type -> malformed
    jsonl.write_text("\n".join(lines) + "\n")
    hf_dir = root / "hf"
    datasets.Dataset(table).save_to_disk(str(hf_dir))
    return {"parquet": parquet_dir, "jsonl": jsonl, "hf": hf_dir}


def expected_statuses(fmt: str) -> list[str]:
    statuses = ["ok"] * 5 + BAD_STATUSES + ["ok"] * (NUM_GOOD - 5)
    return statuses + (["malformed", "malformed"] if fmt == "jsonl" else [])
