"""Synthetic conversations: exact token lengths, determinism, learnable text, and `data synth` (no Ray)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from app.commands import data as data_command
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
