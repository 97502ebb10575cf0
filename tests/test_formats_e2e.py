"""Your model, your data, your template: ShareGPT, Alpaca, OpenAI-with-tool-calls and prompt-completion
files through `data preview` and `train`, with a Llama-3-style tokenizer and a tiny Llama of its vocabulary.

The reference for the labels is transformers' own rendering of the template (`apply_chat_template(...,
tokenize=False)`) and its fast tokenizer's offsets: a token carries a loss exactly when its characters lie
in an assistant turn's body or its <|eot_id|> (found in the rendered string by the header that opens the
turn), never in a header, a user, system or tool turn, or the BOS.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.__main__ import main
from tests.chat_fixtures import ROWS, build_llama3_tokenizer, write_format_files
from tests.run_configs import NO_EXPORT

IGNORE = -100
ASSISTANT_TURN = re.compile(r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)", re.S)
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

# What each row means as an OpenAI chat (or, for string prompt-completion, as (prompt, completion)):
# written by hand here, independently of the format adapters (app/data/formats/).
EXPECTED: dict[str, list] = {
    "sharegpt": [
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "Paris."}],
        [{"role": "user", "content": "Name a prime number."},
         {"role": "assistant", "content": "Seven is prime."},
         {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Eleven."}],
        [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there."}],
        [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One two three."}],
    ],
    "alpaca": [
        [{"role": "user", "content": "Translate to French.\nGood morning"},
         {"role": "assistant", "content": "Bonjour."}],
        [{"role": "user", "content": "Give a synonym of quick."}, {"role": "assistant", "content": "Fast."}],
        [{"role": "user", "content": "Sum the numbers.\ntwo and three"},
         {"role": "assistant", "content": "Five."}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."},
         {"role": "assistant", "content": "Blue."}],
    ],
    "openai_tools": [
        [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
         {"role": "tool", "content": "sunny and warm"},
         {"role": "assistant", "content": "It is sunny and warm in Paris."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."},
         {"role": "assistant", "content": "Hello there."}],
        [{"role": "user", "content": "Name a prime number."},
         {"role": "assistant", "content": "Seven is prime."}],
        [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One two three."}],
    ],
    "prompt_completion": [
        ("The capital of France is", " Paris."),
        ("Seven is", " prime."),
        [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there."}],
        [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}],
    ],
}


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("llama3")
    return build_llama3_tokenizer(root / "tokenizer"), write_format_files(root / "data")


def _preview(tokenizer: Path, data: Path, capsys) -> list[dict]:
    argv = ["data", "preview", "--config", "configs/tiny-cpu.yaml", "-n", "10", "--json",
            "--set", "data.source=path", "--set", f"data.path={data}", "--set", f"data.tokenizer={tokenizer}",
            "--set", "model.name_or_path=tiny-llama"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["rows"]


def _reference(tok, expected) -> tuple[list[int], list[int]]:
    """(ids, labels) from transformers' rendering and the fast tokenizer's character offsets."""
    if isinstance(expected, tuple):  # a string prompt-completion row: no template, EOS ends the completion
        prompt, completion = (tok(text, add_special_tokens=False)["input_ids"] for text in expected)
        ids = prompt + completion + [tok.eos_token_id]
        return ids, [IGNORE] * len(prompt) + completion + [tok.eos_token_id]
    text = tok.apply_chat_template(expected, tokenize=False)
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [match.span(1) for match in ASSISTANT_TURN.finditer(text)]
    labels = [token if any(start <= a and b <= end for start, end in spans) and b > a else IGNORE
              for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]
    return encoded["input_ids"], labels


def test_preview_labels_exactly_the_assistant_tokens_of_every_format(llama_data, capsys) -> None:
    from transformers import AutoTokenizer

    tokenizer, files = llama_data
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    for name, path in files.items():
        rows = _preview(tokenizer, path, capsys)
        assert [row["status"] for row in rows] == ["ok"] * len(ROWS[name]), (name, rows)
        for row, expected in zip(rows, EXPECTED[name], strict=True):
            ids, labels = _reference(tok, expected)
            assert row["input_ids"] == ids, (name, row["index"], tok.decode(row["input_ids"]))
            assert row["labels"] == labels, (name, row["index"])
            assert row["num_tokens"] == len(ids)
            assert row["label_tokens"] == sum(label != IGNORE for label in labels[1:])
            assert row["format"] in {"sharegpt", "alpaca", "messages", "prompt_completion"}


def _train_config(tokenizer: Path, root: Path, name: str, *overrides: str):
    from app.config import load_config

    return load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={root}", f"run.name={name}", "model.name_or_path=tiny-llama",
        f"data.tokenizer={tokenizer}", "scheduling.global_batch_size=16", "train.steps=2",
        "data.shuffle=false", NO_EXPORT, *overrides])


@pytest.fixture(scope="module")
def recorded_maps() -> Iterator[list[str]]:
    """The function of every `Dataset.map_batches` this process builds while the module runs (a tokenize
    task runs only through one)."""
    import ray.data

    original = ray.data.Dataset.map_batches
    names: list[str] = []

    def recording(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(getattr(fn, "__name__", repr(fn)))
        return original(self, fn, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray.data.Dataset, "map_batches", recording)
        yield names


@pytest.fixture(scope="module")
def formats_run(llama_data, local_ray, recorded_maps,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tokenizing run over the four files (16 rows, one global batch of 16, 2 steps): its summary, the
    calls the driver made, its stdout and the maps it built."""
    from app.train.driver import train
    from tests.call_counter import counted_calls

    tokenizer, files = llama_data
    data = next(iter(files.values())).parent
    config = _train_config(tokenizer, tmp_path_factory.mktemp("runs"), "formats", "data.source=path",
                           f"data.path={data}")
    terminal, stdout = io.StringIO(), io.StringIO()
    recorded_maps.clear()
    with counted_calls("app.data.tokenizer", "load_tokenizer") as loads, \
            counted_calls("app.data.readers", "resolve_source") as resolves, \
            contextlib.redirect_stdout(stdout):
        summary = train(config, quiet=True, out=terminal)  # progress on: the summary and an example row
    return {"summary": summary, "loads": loads, "resolves": [args[0].path for args in resolves],
            "stdout": stdout.getvalue(), "maps": list(recorded_maps), "data": data}


def test_train_runs_two_steps_on_every_format(llama_data, formats_run) -> None:
    """Every row of every format trains in step 1, on a tiny Llama whose vocabulary is the tokenizer's. The
    driver process loads the tokenizer and resolves the data source once (app/data/resolved.py), example
    row and cost model included."""
    tokenizer, _ = llama_data
    summary = formats_run["summary"]
    assert "example training row" in formats_run["stdout"]  # sys.stdout, not the run's log
    assert formats_run["loads"] == [(str(tokenizer),)]
    assert formats_run["resolves"] == [str(formats_run["data"])]
    assert formats_run["maps"] == ["tokenize"]
    assert summary.steps == 2
    first = json.loads(Path(summary.run_dir, "samples.jsonl").read_text().splitlines()[0])
    assert sorted(i for line in [first] for i in line["sample_ids"]) == list(range(16))
    data_summary = json.loads(Path(summary.run_dir, "data_summary.json").read_text())
    assert data_summary["rows"] == 16 and data_summary["usable_rows"] == 16, data_summary


def _samples(run_dir: str) -> list[tuple[int, list[int]]]:
    lines = [json.loads(line) for line in Path(run_dir, "samples.jsonl").read_text().splitlines()]
    return sorted((line["step"], sorted(line["sample_ids"])) for line in lines)


def _sets(*overrides: str) -> list[str]:
    return [part for override in overrides for part in ("--set", override)]


def test_a_prepared_set_trains_on_the_same_rows_without_tokenizing(
        llama_data, formats_run, recorded_maps, tmp_path: Path, capsys) -> None:
    """`data prepare` (three tokenize tasks, a shard per block: one or more a file) writes exactly the rows
    a tokenizing run streams; a run on it builds no tokenize map, reads the manifest and loads the
    tokenizer once, and trains the same samples to the same losses. The set, prepared again from other
    data, no longer resumes that run (exit 2)."""
    from app.data.pipeline import tokenized_dataset
    from app.data.resolved import resolve_data
    from app.train.driver import train
    from scheduling.actor import read_row_table
    from tests.call_counter import counted_calls

    tokenizer, files = llama_data
    prepared = tmp_path / "prepared"
    common = ["model.name_or_path=tiny-llama", f"data.tokenizer={tokenizer}", "data.tokenize_concurrency=3"]
    prepare = ["data", "prepare", "--config", "configs/tiny-cpu.yaml", "--out", str(prepared),
               *_sets(*common, "data.source=path")]
    assert main([*prepare, *_sets(f"data.path={formats_run['data']}")]) == 0
    from_prepared = ("data.source=prepared", f"data.path={prepared}")
    config = _train_config(tokenizer, tmp_path, "from-prepared", *from_prepared)
    tokenizing = formats_run["summary"]
    raw = _train_config(tokenizer, tmp_path, "raw", "data.source=path", f"data.path={formats_run['data']}")
    streamed, shards = (read_row_table(tokenized_dataset(
        resolve_data(c.data, max_length=c.max_sequence_length), num_cpus=0.5)) for c in (raw, config))
    assert len(shards) == len(streamed) == 16
    assert len(json.loads((prepared / "skrull_prepared.json").read_text())["shards"]) >= 4
    for position in range(16):
        for got, want in zip(shards.tokens(position), streamed.tokens(position), strict=True):
            assert got.tolist() == want.tolist(), position
    recorded_maps.clear()
    with counted_calls("app.data.tokenizer", "load_tokenizer") as loads, \
            counted_calls("app.data.prepared", "read_manifest") as manifests:
        summary = train(config, quiet=True, out=io.StringIO())
    assert (recorded_maps, len(loads), len(manifests)) == ([], 1, 1)
    assert _samples(summary.run_dir) == _samples(tokenizing.run_dir)
    assert summary.losses == pytest.approx(tokenizing.losses, rel=1e-6)
    one_file = next(iter(files.values()))
    assert main([*prepare, *_sets(f"data.path={one_file}"), "--overwrite"]) == 0
    capsys.readouterr()
    resume = _sets(f"run.storage_path={tmp_path}", "run.name=from-prepared", "train.steps=3", *from_prepared,
                   "model.name_or_path=tiny-llama", f"data.tokenizer={tokenizer}", "data.shuffle=false",
                   "scheduling.global_batch_size=16")
    assert main(["train", "--config", "configs/tiny-cpu.yaml", *resume]) == 2
    assert "data.path: the data changed" in capsys.readouterr().err
