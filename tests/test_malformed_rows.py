"""Malformed rows are loud: reasons per row, the scan's counts by reason, data.max_malformed_fraction.

In process, without Ray: the pre-start scan (`scan_dataset`) runs on TokenizeBatch's output through a
stand-in for the two Ray Dataset methods it calls; `plan` runs through app.__main__.main.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from app.__main__ import main
from app.config import ConfigError, load_config
from app.data.formats import NO_FORMAT
from app.data.lengths import dataset_token_lengths, scan_local
from app.data.malformed import MalformedTally, check_malformed
from app.data.ray_ops import TokenizeBatch
from app.data.resolved import template_settings
from app.data.scan import DataScan, scan_dataset
from app.data.split import as_eval_path_error, eval_data_config
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer

GOOD = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}
NUMBER_CONTENT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 4}]}
NUMBER_REASON = "messages[1].content is a number, not a string"


class _Batches:
    """The part of a ray.data.Dataset that scan_dataset uses, over one pyarrow Table."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def select_columns(self, names: list[str]) -> _Batches:
        return _Batches(self.table.select(names))

    def iter_batches(self, batch_size: int, batch_format: str) -> Iterator[dict[str, np.ndarray]]:
        assert batch_format == "numpy"
        for batch in self.table.to_batches(max_chunksize=batch_size):
            yield {name: batch.column(name).to_numpy(zero_copy_only=False) for name in batch.schema.names}


def _write_jsonl(path: Path, rows: list[dict[str, Any] | str]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _half_malformed(tmp_path: Path) -> Path:
    """80 lines: good rows at even positions, number-content rows at odd ones (the first at row 1)."""
    return _write_jsonl(tmp_path / "half.jsonl", [GOOD if i % 2 == 0 else NUMBER_CONTENT for i in range(80)])


def _scan(path: Path, *sets: str) -> DataScan:
    """scan_dataset over the file's JSONL lines tokenized by TokenizeBatch, as Ray Data would feed it."""
    cfg = load_config("configs/tiny-cpu.yaml", ["data.source=path", f"data.path={path}", *sets])
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    table = TokenizeBatch("qwen", template_settings(cfg.data, cfg.max_sequence_length), True)(
        pa.table({"text": lines}))
    return scan_dataset(_Batches(table), cfg.data, max_length=cfg.max_sequence_length)


def test_every_malformed_row_says_why() -> None:
    rows = [
        GOOD, NUMBER_CONTENT,
        {"json_line": '{"messages": [1, 2'},
        {"json_line": "[1, 2]"},
        {},
        {"messages": "a string"},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": 3, "content": "x"}]},
        {"messages": ["hello"]},
        {"text": 7},
    ]
    out = tokenize_rows(rows, load_tokenizer("qwen"), TemplateSettings())
    assert out.reason == [
        "", NUMBER_REASON,
        "bad JSON (Expecting ',' delimiter)",
        "a JSON line must be an object, not a list",
        NO_FORMAT,
        "messages is a string, not a list of {role, content}",
        "messages[0] has no content",
        "messages[0].role is a number, not a string",
        "messages[0] is a string, not a {role, content} object",
        "text is a number, not a string",
    ]
    assert out.status == ["ok"] + ["malformed"] * 9


def test_scan_counts_malformed_rows_by_reason_and_stops_above_the_fraction(tmp_path: Path) -> None:
    path = _half_malformed(tmp_path)
    with pytest.raises(ConfigError) as err:
        _scan(path)
    message = str(err.value)
    assert f"data.path={str(path)!r}" in message
    assert "40 of 80 rows read (fraction 0.5) are malformed" in message
    assert "data.max_malformed_fraction=0.05" in message
    assert f"most common reason: {NUMBER_REASON!r} (40 rows), first malformed row: 1" in message

    scan = _scan(path, "data.max_malformed_fraction=0.6")
    assert scan.num_rows == 80 and scan.num_usable == 40 and scan.counts["malformed"] == 40
    assert dict(scan.malformed.reasons) == {NUMBER_REASON: 40}
    assert scan.malformed.first == (1, NUMBER_REASON)
    assert scan.summary().startswith("data: 40/80 rows usable, ")
    assert scan.summary().endswith(f"malformed=40 (40 {NUMBER_REASON!r}; first: row 1)")


def test_mixed_reasons_name_the_first_row_and_the_most_common(tmp_path: Path) -> None:
    rows: list[dict[str, Any] | str] = [GOOD] * 6 + ["not json", {"prompt": "x"}, *[NUMBER_CONTENT] * 2]
    scan = _scan(_write_jsonl(tmp_path / "mixed.jsonl", rows), "data.max_malformed_fraction=0.5")
    assert scan.malformed.first == (6, "bad JSON (Expecting value)")
    assert scan.summary().endswith(
        f"malformed=4 (2 {NUMBER_REASON!r}, 1 'bad JSON (Expecting value)', 1 {NO_FORMAT!r}; "
        "first: row 6, 'bad JSON (Expecting value)')")
    assert scan.malformed.as_json() == {
        "count": 4, "by_reason": {NUMBER_REASON: 2, "bad JSON (Expecting value)": 1,
                                  NO_FORMAT: 1},
        "first_row": 6, "first_reason": "bad JSON (Expecting value)"}


def test_many_reasons_keep_the_line_short() -> None:
    tally = MalformedTally()
    tally.add(["ok", "ok"], ["", ""])
    tally.add(["malformed"] * 5 + ["ok"], ["a", "a", "b", "c", "d", ""])
    assert tally.first == (2, "a") and tally.rows == 8 and tally.fraction == 5 / 8
    assert tally.breakdown() == "2 'a', 1 'b', 1 'c', 1 with 1 other reason; first: row 2, 'a'"


def test_plan_lengths_apply_the_same_limit(tmp_path: Path) -> None:
    """`plan`'s local reader (dataset_token_lengths) stops on the half-malformed file, passes with 0.6."""
    path = _half_malformed(tmp_path)
    with pytest.raises(ConfigError, match=r"40 of 80 rows read \(fraction 0.5\) are malformed"):
        dataset_token_lengths(load_config(None, ["data.source=path", f"data.path={path}"]).data)
    sets = ["data.source=path", f"data.path={path}", "data.max_malformed_fraction=0.6"]
    assert len(dataset_token_lengths(load_config(None, sets).data)) == 40


def test_a_clean_file_and_the_limit_itself_pass(tmp_path: Path) -> None:
    assert _scan(_write_jsonl(tmp_path / "clean.jsonl", [GOOD] * 4)).summary().endswith("label tokens)")
    tally = MalformedTally()
    tally.add(["ok"] * 19 + ["malformed"], [""] * 19 + [NO_FORMAT])
    check_malformed(load_config(None, []).data, tally)  # 1/20 = 0.05 is not above the default


def test_eval_path_errors_name_data_eval_path(tmp_path: Path) -> None:
    path = _half_malformed(tmp_path)
    data = load_config(None, ["data.source=path", f"data.path={tmp_path / 'train.jsonl'}",
                              f"data.eval_path={path}"]).data
    tally = MalformedTally()
    tally.add(["ok", "malformed"], ["", NUMBER_REASON])
    with pytest.raises(ConfigError) as err:
        check_malformed(eval_data_config(data), tally)
    message = str(as_eval_path_error(err.value, data))
    assert message.startswith(f"data.eval_path={str(path)!r}: 1 of 2 rows read (fraction 0.5)")
    assert "data.max_malformed_fraction" in message


def test_max_malformed_fraction_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"data.max_malformed_fraction must be in \[0, 1\]"):
        load_config(None, ["data.max_malformed_fraction=1.5"])


def test_plan_on_an_unreadable_file_names_the_file_fraction_and_reason(tmp_path: Path, capsys) -> None:
    path = _write_jsonl(tmp_path / "numbers.jsonl", [NUMBER_CONTENT] * 12)
    code = main(["plan", "--config", "configs/tiny-cpu.yaml", "--set", "data.source=path",
                 "--set", f"data.path={path}", "--set", "plan.num_batches=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"skrull plan: error: data.path={str(path)!r}: 12 of 12 rows read (fraction 1) are malformed" \
        in err
    assert f"most common reason: {NUMBER_REASON!r}" in err and "data.max_malformed_fraction=0.05" in err
    assert "gave 0 sequences" not in err


MIXED = [
    GOOD,
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    {"instruction": "Name a color.", "input": "", "output": "Blue."},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}],
     "system": "Be terse."},
    {"prompt": "The sky is", "completion": " blue."},
    {"text": "A plain text row."},
    {"question": "no known column"},
    {"conversations": [{"from": "bot", "value": "?"}]},
]
MIXED_FORMATS = {"sharegpt": 2, "alpaca": 1, "messages": 1, "prompt_completion": 1, "text": 1}


def test_the_summary_says_which_format_read_the_rows(tmp_path: Path) -> None:
    """data.format_type=auto reads each row by its keys; the line counts the rows read by format, and the
    malformed ones (no format's keys, or a format's keys it could not read) by reason."""
    path = _write_jsonl(tmp_path / "mixed.jsonl", MIXED)
    scan = _scan(path, "data.max_malformed_fraction=0.3")
    assert scan.num_rows == 8 and scan.num_usable == 6 and scan.formats == MIXED_FORMATS
    bot = "conversations[0].from is 'bot', not one of human, gpt, system, tool, function_call, observation " \
          "(or user, assistant)"
    assert scan.summary().endswith(
        f"malformed=2 (1 {NO_FORMAT!r}, 1 {bot!r}; first: row 6, {NO_FORMAT!r}); "
        "formats: sharegpt=2, alpaca=1, messages=1, prompt_completion=1, text=1")
    plan = scan_local(load_config(None, ["data.source=path", f"data.path={path}",
                                         "data.max_malformed_fraction=0.3"]).data)
    assert plan.as_json()["formats"] == MIXED_FORMATS and len(plan.lengths) == 6
    assert plan.as_json()["malformed"]["count"] == 2


def test_the_stop_message_says_how_to_tell_the_format(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "keys.jsonl", [{"question": "q", "answer": "a"}] * 3)
    with pytest.raises(ConfigError) as err:
        _scan(path)
    assert f"most common reason: {NO_FORMAT!r} (3 rows)" in str(err.value)
    assert "data.format_type=auto (auto|messages|sharegpt|alpaca|prompt_completion|text) and data.columns" \
        in str(err.value)
    mapped = _scan(path, "data.columns={instruction: question, output: answer}")
    assert mapped.num_usable == 3 and mapped.formats == {"alpaca": 3}
