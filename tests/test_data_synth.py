"""Synthetic conversations: exact token lengths, determinism, learnable text, and `data synth` (no Ray)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from app.commands import data as data_command
from app.commands import staging
from app.config import ConfigError
from app.data.synth import ConversationSynth, synth_conversations, target_lengths
from app.data.template import TemplateSettings, tokenize_rows
from app.data.tokenizer import load_tokenizer
from scheduling import sample_lengths


@pytest.fixture(scope="module")
def synth() -> ConversationSynth:
    return ConversationSynth(load_tokenizer("qwen"))


def token_lengths(synth: ConversationSynth, conversations: list) -> np.ndarray:
    out = tokenize_rows([{"messages": c} for c in conversations], synth.tok, TemplateSettings())
    assert set(out.status) == {"ok"}
    return np.asarray(out.raw_tokens)


@pytest.mark.parametrize("dist", ["lmsys", "wikipedia", "chatqa2"])
def test_token_lengths_hit_targets(synth: ConversationSynth, dist: str) -> None:
    n, scale = 200, 0.2
    targets = target_lengths(dist, n, seed=3, length_scale=scale)
    assert np.array_equal(targets, np.maximum(1, np.rint(sample_lengths(dist, n, 3) * scale)))
    conversations = synth_conversations(synth, np.arange(n), targets, dist, seed=3)
    # With Qwen every vocabulary word is one BPE token, so lengths are exact, not approximately right.
    assert np.array_equal(token_lengths(synth, conversations), np.maximum(targets, synth.min_length()))


def test_lmsys_shape_multi_turn(synth: ConversationSynth) -> None:
    conversations = synth_conversations(synth, np.arange(400), np.full(400, 600), "lmsys", seed=0)
    turns = np.array([sum(m["role"] == "user" for m in c) for c in conversations])
    assert 1.6 <= turns.mean() <= 2.4  # LMSYS-Chat-1M averages 2.0 turns
    for c in conversations:
        roles = [m["role"] for m in c if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_rows_depend_only_on_seed_and_id(synth: ConversationSynth) -> None:
    ids, targets = np.arange(50), np.full(50, 300)
    whole = synth_conversations(synth, ids, targets, "lmsys", seed=1)
    fresh = ConversationSynth(synth.tok)
    pieces = synth_conversations(fresh, ids[30:], targets[30:], "lmsys", seed=1)
    assert pieces == whole[30:]
    # A very long sample in between (which grows the word stream) changes nothing for the others.
    fresh.conversation(np.random.default_rng(0), 400_000, "wikipedia")
    assert synth_conversations(fresh, ids[:5], targets[:5], "lmsys", seed=1) == whole[:5]
    assert synth_conversations(synth, ids[:5], targets[:5], "lmsys", seed=2) != whole[:5]


def test_text_is_learnable(synth: ConversationSynth) -> None:
    """The next token given the previous one is nearly determined: bigram entropy << log(vocab)."""
    text = " ".join(m["content"] for c in synth_conversations(
        synth, np.arange(40), np.full(40, 2000), "wikipedia", seed=0) for m in c)
    ids = np.asarray(synth.tok.encode(text))
    pairs, counts = np.unique(np.stack([ids[:-1], ids[1:]]), axis=1, return_counts=True)
    totals: dict[int, int] = {}
    for prev, count in zip(pairs[0].tolist(), counts.tolist(), strict=True):
        totals[prev] = totals.get(prev, 0) + count
    p_pair = counts / counts.sum()
    p_cond = counts / np.array([totals[p] for p in pairs[0].tolist()])
    conditional_entropy = float(-(p_pair * np.log(p_cond)).sum())
    # 4 successors with p = .55/.25/.12/.08 have entropy 1.13 nats; ln(151,936) = 11.9 for random tokens.
    assert conditional_entropy < 1.5


def test_data_synth_command_writes_parquet(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    data_command.add_arguments(parser)
    out = tmp_path / "lmsys"
    argv = ["synth", "--dist", "lmsys", "--n", "300", "--out", str(out), "--seed", "5",
            "--length-scale", "0.5", "--rows-per-file", "128", "--json"]
    assert data_command.run(parser.parse_args(argv)) == 0
    summary = json.loads(capsys.readouterr().out)
    files = sorted(out.glob("*.parquet"))
    assert len(files) == summary["files"] == 3
    table = pq.read_table(out)
    assert table.column("sample_id").to_pylist() == list(range(300))
    assert table.schema.field("messages").type.value_type.names == ["role", "content"]
    assert summary["rows"] == 300 and summary["verified_rows"] == 300 and summary["abs_error_max"] == 0
    synth = ConversationSynth(load_tokenizer("qwen"))
    lengths = token_lengths(synth, table.column("messages").to_pylist())
    expected = np.maximum(target_lengths("lmsys", 300, 5, 0.5), synth.min_length())
    assert np.array_equal(lengths, expected) and summary["tokens"] == int(expected.sum())
    with pytest.raises(ValueError, match="--overwrite"):
        data_command.run(parser.parse_args(argv))


def _synth_argv(out, *extra: str) -> list[str]:
    return ["synth", "--dist", "lmsys", "--n", "40", "--out", str(out), "--length-scale", "0.2",
            "--rows-per-file", "16", "--json", *extra]


def _run_synth(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    data_command.add_arguments(parser)
    return data_command.run(parser.parse_args(argv))


def _snapshot(root) -> dict[str, bytes]:
    """Every file under root (hidden ones included) by relative path: 'exactly as it was' is equality."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def written(tmp_path, capsys):
    """A previous `data synth` output (3 files) in tmp_path/parent/out, and a snapshot of tmp_path/parent."""
    out = tmp_path / "parent" / "out"
    assert _run_synth(_synth_argv(out, "--seed", "1")) == 0
    capsys.readouterr()
    assert len(list(out.glob("part-*.parquet"))) == 3
    return out, _snapshot(out.parent)


def test_overwrite_with_a_bad_tokenizer_leaves_the_old_files(written, capsys) -> None:
    from app.__main__ import main

    out, before = written
    assert main(["data", *_synth_argv(out, "--overwrite", "--tokenizer", str(out / "missing.json"))]) == 2
    assert "data.tokenizer" in capsys.readouterr().err  # the tokenizer loader's message
    assert _snapshot(out.parent) == before  # nothing deleted, nothing left behind


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("boom")])
def test_a_failure_while_writing_leaves_the_target_as_it_was(written, monkeypatch, error) -> None:
    import pyarrow.parquet as pq

    out, before = written
    real, calls = pq.write_table, []

    def write_then_fail(table, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the first file is written, the second fails
            raise error
        return real(table, path, *args, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_then_fail)
    if isinstance(error, OSError):  # an OSError is the --out's fault: one ConfigError naming it
        expected = (ConfigError, rf"--out='{out}' cannot be written .*No space left")
    else:  # anything else is a bug: re-raised as it is, after the cleanup
        expected = (RuntimeError, "boom")
    with pytest.raises(expected[0], match=expected[1]):
        _run_synth(_synth_argv(out, "--overwrite", "--seed", "2"))
    assert calls[0].parent.parent == out.parent  # it wrote into a staging dir next to --out, not into --out
    assert _snapshot(out.parent) == before


def test_a_failure_while_swapping_leaves_the_target_as_it_was(written, monkeypatch) -> None:
    out, before = written
    real = os.rename

    def no_rename_into_out(src, dst):
        if str(dst) == str(out) and ".synth-" in str(src):
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(staging.os, "rename", no_rename_into_out)
    with pytest.raises(ConfigError, match="--out=.*cannot be written"):
        _run_synth(_synth_argv(out, "--overwrite", "--seed", "2"))
    assert _snapshot(out.parent) == before


def test_overwrite_replaces_every_old_file_and_keeps_the_directory_mode(written, capsys) -> None:
    out, before = written
    out.chmod(0o750)
    argv = _synth_argv(out, "--overwrite", "--seed", "2", "--n", "10")
    assert _run_synth(argv) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no staging or old dir left behind
    assert [p.name for p in out.iterdir()] == ["part-00000.parquet"]  # the old part-00001/2 are gone
    assert pq.read_table(out).num_rows == 10 and (out.stat().st_mode & 0o777) == 0o750


def test_overwrite_keeps_other_files_of_the_target(written, capsys, monkeypatch) -> None:
    """--out holding more than parquet files: the parquet files are swapped one rename at a time."""
    out, _ = written
    (out / "README.txt").write_text("my notes")
    before = _snapshot(out.parent)
    real = os.rename

    def fail_on_the_second_new_file(src, dst):
        if str(dst).endswith("part-00001.parquet") and ".out.synth-" in str(src):  # staging -> out only
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(staging.os, "rename", fail_on_the_second_new_file)
    with pytest.raises(ConfigError, match="--out="):
        _run_synth(_synth_argv(out, "--overwrite", "--seed", "2"))
    assert _snapshot(out.parent) == before  # old files moved back, the new one taken out again
    monkeypatch.setattr(staging.os, "rename", real)
    assert _run_synth(_synth_argv(out, "--overwrite", "--seed", "2", "--n", "10")) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["README.txt", "part-00000.parquet"]
    assert (out / "README.txt").read_text() == "my notes"
    assert pq.read_table(out / "part-00000.parquet").num_rows == 10


def test_unwritable_out_is_one_error_naming_it(tmp_path, capsys) -> None:
    from app.__main__ import main

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out in (a_file / "out", a_file / "deeper" / "out", a_file):  # parent is a file; --out is a file
        assert main(["data", *_synth_argv(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("skrull data: error: --out=") and str(out) in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and a_file.read_text() == "x"


def test_new_nested_out_and_its_parents_vanish_on_failure(tmp_path, monkeypatch, capsys) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "a" / "b" / "out"
    monkeypatch.setattr(pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "disk full")))
    with pytest.raises(ConfigError, match="--out="):
        _run_synth(_synth_argv(out))
    assert list(tmp_path.iterdir()) == []  # the parents it created are removed again
    monkeypatch.undo()
    assert _run_synth(_synth_argv(out)) == 0
    capsys.readouterr()
    assert len(list(out.glob("part-*.parquet"))) == 3
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_out_under_a_read_only_directory_is_one_error_naming_it(tmp_path, monkeypatch, capsys) -> None:
    """Tests run as root, where chmod does not stop writes: the read-only directory is simulated."""
    import pathlib

    from app.__main__ import main

    def read_only(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    assert main(["data", *_synth_argv(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--out='{tmp_path / 'out'}' cannot be written (PermissionError" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
