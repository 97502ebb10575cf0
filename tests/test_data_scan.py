"""The run's data summary, the scan's errors and the tokenizer's output columns, without Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from app.config import load_config
from app.data import DataError
from app.data.ray_ops import MESSAGES_TYPE, TokenizeBatch
from app.data.resolved import template_settings
from app.data.scan import DataScan, check_scan
from scheduling.payload import ROW_STATUSES

LONG_CONTEXT = [{"role": "user", "content": " ".join(["a long context about the data"] * 20)},
                {"role": "assistant", "content": "Short answer."}]


def _counts(**nonzero: int) -> dict[str, int]:
    return {status: nonzero.get(status, 0) for status in ROW_STATUSES}


def test_summary_reports_label_tokens_and_what_truncation_did() -> None:
    scan = DataScan(num_rows=320, lengths=np.full(318, 170), label_tokens=12000,
                    counts=_counts(ok=313, truncated=5, truncated_empty=2))
    assert scan.num_usable == 318
    assert scan.summary() == ("data: 318/320 rows usable, 54060 tokens (12000 label tokens), truncated=5, "
                              "truncated_empty=2")
    clean = DataScan(num_rows=3, lengths=np.array([4, 5, 6]), label_tokens=7, counts=_counts(ok=3))
    assert clean.summary() == "data: 3/3 rows usable, 15 tokens (7 label tokens)"



def test_summary_names_the_formats_unless_every_row_is_messages() -> None:
    """The rows by format close the line (most first); a messages-only (or synthetic) run's line is as
    it was, and a scan without the malformed rows shows their count and reasons before the formats."""
    mixed = DataScan(num_rows=320, lengths=np.full(318, 170), label_tokens=12000,
                     counts=_counts(ok=318, malformed=2), formats={"sharegpt": 310, "alpaca": 8})
    mixed.malformed.add(["malformed", "malformed"], ["no messages column", "no messages column"])
    assert mixed.summary() == ("data: 318/320 rows usable, 54060 tokens (12000 label tokens), malformed=2 "
                               "(2 'no messages column'; first: row 0); formats: sharegpt=310, alpaca=8")
    one = DataScan(num_rows=3, lengths=np.array([4, 5, 6]), label_tokens=7, counts=_counts(ok=3),
                   formats={"text": 3})
    assert one.summary() == "data: 3/3 rows usable, 15 tokens (7 label tokens); formats: text=3"
    chats = DataScan(num_rows=3, lengths=np.array([4, 5, 6]), label_tokens=7, counts=_counts(ok=3),
                     formats={"messages": 3})
    assert chats.summary() == "data: 3/3 rows usable, 15 tokens (7 label tokens)"


def test_tokenize_batch_output_columns() -> None:
    table = pa.table({"messages": pa.array([LONG_CONTEXT, LONG_CONTEXT[:1]], MESSAGES_TYPE)})
    for side, expected in (("left", ["truncated", "empty"]), ("right", ["truncated_empty", "empty"])):
        cfg = load_config(None, ["data.too_long=truncate", f"data.truncate_side={side}"]).data
        out = TokenizeBatch("qwen", template_settings(cfg, 32))(table)
        assert out.column_names == ["input_ids", "labels", "num_tokens", "raw_tokens", "label_tokens",
                                    "status", "reason", "format", "source"]
        assert out.column("reason").to_pylist() == ["", ""]
        assert out.column("format").to_pylist() == ["messages", "messages"]
        assert out.column("status").to_pylist() == expected
        assert out.column("label_tokens").type == pa.int64()
        labels = out.column("labels").to_pylist()[0]
        expected_labels = sum(1 for t in labels[1:] if t != -100)  # after the shift
        assert out.column("label_tokens").to_pylist() == [expected_labels, 0]
        assert (expected_labels > 0) == (side == "left")
        assert out.column("num_tokens").to_pylist() == [32 if side == "left" else 0, 0]


def test_no_usable_rows_names_the_knobs() -> None:
    data = load_config(None, ["data.too_long=truncate", "data.truncate_side=right"]).data
    emptied = DataScan(num_rows=4, lengths=np.zeros(0, dtype=np.int64), counts=_counts(truncated_empty=4))
    with pytest.raises(DataError, match=r"no usable rows in data.source=synthetic .*truncated_empty=4\); "
                                        r"truncation to 64 tokens cut every label token away "
                                        r".*data.truncate_side=right.*raise data.max_length"):
        check_scan(data, emptied, np.zeros(0, dtype=np.int64), max_length=64)
    empty = DataScan(num_rows=2, lengths=np.zeros(0, dtype=np.int64), counts=_counts(empty=2))
    with pytest.raises(DataError, match=r"empty=2\); empty rows have no label token \(data.labels=assistant"):
        check_scan(data, empty, np.zeros(0, dtype=np.int64), max_length=64)
