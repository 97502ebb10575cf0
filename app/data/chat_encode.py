"""Rendered chats -> token ids, and which tokens fall inside given character spans (the label spans).

A rendered chat is a chat template's output string (app/data/chat_template.py). The template's own control
tokens (TextTokenizer.control_tokens: special tokens, and added tokens the template writes) encode to
their ids. A control-token string that came from the data was wrapped in two private-use markers before
rendering (`escape_controls`): it is encoded as plain text and the markers vanish, so text in a message
can never forge a turn boundary, a BOS or a tool call.

    HF tokenizers    a chat without markers: the transformers tokenizer encodes the whole string
                     (add_special_tokens=False), which is exactly apply_chat_template(tokenize=True), with
                     character offsets;
                     with markers: cut at them, each piece encoded on its own, the escaped ones as plain
                     text, the later ones behind a "\\n" that is then dropped (transformers' own
                     sanitize_control_tokens rule, so the ids are apply_chat_template's with it)
    qwen (tiktoken)  cut at control tokens and markers; the text pieces of a whole batch go to one
                     encode_ordinary_batch call (tiktoken's encode with special tokens allowed makes the
                     same cut); a token's characters follow from the byte lengths of the tokens before it

A token is inside a span when its characters overlap it, so a token that BPE merged across a span boundary
(a header's "\\n" with an answer that starts with "\\n") counts as inside, as in transformers'
return_assistant_tokens_mask. A zero-width token (offsets trimmed to nothing) counts as one character wide.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.data.tokenizer import TextTokenizer

MARK_START, MARK_END = "\U000f0000", "\U000f0001"
"""The markers around a control-token string that came from the data (transformers uses the same two)."""

Span = tuple[int, int]
EncodedChat = tuple[np.ndarray, np.ndarray]
"""(int32 ids, bool mask: the token overlaps one of the chat's spans)."""


@dataclass(frozen=True)
class Controls:
    """A template's control tokens (text -> id) and the patterns that find them."""

    ids: dict[str, int]
    any: re.Pattern[str]
    """A control token (longest first, so a token wins over the tokens it contains)."""
    cut: re.Pattern[str]
    """An escaped token (group 1), a template's own token (group 2), or a lone marker."""
    bare: re.Pattern[str]
    """`cut` for a string without markers: a template's own token (group 1)."""
    at_end: re.Pattern[str]
    """A control token that ends the string."""


def controls_of(ids: Mapping[str, int]) -> Controls:
    tokens = "|".join(map(re.escape, sorted(ids, key=len, reverse=True))) or "(?!)"  # (?!) never matches
    marks = f"{MARK_START}{MARK_END}"
    return Controls(
        ids=dict(ids), any=re.compile(tokens),
        cut=re.compile(f"{MARK_START}({tokens}){MARK_END}|({tokens})|[{marks}]"),
        bare=re.compile(f"({tokens})"),
        at_end=re.compile(f"(?:{tokens})\\Z"))


def escape_controls(value: Any, controls: Controls, nfc: bool = False) -> Any:
    """`value` with every control-token string in its strings wrapped in markers (lists, tuples and dict
    values deeply; keys stay). Markers already in the data are removed first, so none can be forged.
    With `nfc`, strings are NFC-normalized too (the qwen tokenizer encodes NFC text)."""
    if isinstance(value, str):
        if nfc and not unicodedata.is_normalized("NFC", value):
            value = unicodedata.normalize("NFC", value)
        if not (controls.any.search(value) or _has_marks(value)):  # one regex of literals: fast
            return value
        clean = value.replace(MARK_START, "").replace(MARK_END, "")
        return controls.any.sub(lambda match: f"{MARK_START}{match.group(0)}{MARK_END}", clean)
    if isinstance(value, Mapping):
        return {key: escape_controls(item, controls, nfc) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_controls(item, controls, nfc) for item in value]
    return value


def encode_chats(tok: TextTokenizer, texts: Sequence[str], spans: Sequence[Sequence[Span]],
                 controls: Controls) -> list[EncodedChat | str]:
    """Each rendered chat -> (ids, in-span mask), or a reason when an escaped string cannot stay text."""
    if tok.kind == "tiktoken":
        return _encode_tiktoken(tok, texts, spans, controls)
    return _encode_hf(tok, texts, spans, controls)


def in_spans(starts: np.ndarray, ends: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """Tokens whose characters [start, end) overlap a span."""
    ends = np.maximum(ends, starts + 1)
    mask = np.zeros(len(starts), dtype=bool)
    for first, last in spans:
        mask |= (starts < last) & (ends > first)
    return mask


def _has_marks(text: str) -> bool:
    return MARK_START in text or MARK_END in text


def _encode_hf(tok: TextTokenizer, texts: Sequence[str], spans: Sequence[Sequence[Span]],
               controls: Controls) -> list[EncodedChat | str]:
    hf = tok.hf()
    out: list[EncodedChat | str] = [""] * len(texts)
    plain = [i for i, text in enumerate(texts) if not _has_marks(text)]
    if plain:
        encoded = hf([texts[i] for i in plain], add_special_tokens=False, return_offsets_mapping=True,
                     return_attention_mask=False)
        for row, i in enumerate(plain):
            offsets = np.asarray(encoded["offset_mapping"][row], dtype=np.int64).reshape(-1, 2)
            out[i] = (np.asarray(encoded["input_ids"][row], dtype=np.int32),
                      in_spans(offsets[:, 0], offsets[:, 1], spans[i]))
    for i, text in enumerate(texts):
        if _has_marks(text):
            out[i] = _encode_hf_marked(hf, text, spans[i], controls)
    return out


def _encode_hf_marked(hf: Any, text: str, spans: Sequence[Span], controls: Controls) -> EncodedChat | str:
    """A chat with escaped control tokens, piece by piece (see the module docstring)."""
    newline = hf.encode("\n", add_special_tokens=False)
    ids: list[int] = []
    offsets: list[np.ndarray] = []
    for index, (start, end, escaped) in enumerate(_marked_pieces(text, controls)):
        piece = text[start:end]
        if not piece and index:
            continue
        piece_ids, piece_offsets = _encode_piece(hf, piece, escaped, newline, after_newline=index > 0)
        if escaped and controls.ids[piece] in piece_ids:
            return f"data.tokenizer encodes {piece!r} as its special token even as plain text"
        ids += piece_ids
        offsets.append(piece_offsets + start)
    spans_of = np.concatenate(offsets) if offsets else np.zeros((0, 2), dtype=np.int64)
    return np.asarray(ids, dtype=np.int32), in_spans(spans_of[:, 0], spans_of[:, 1], spans)


def _marked_pieces(text: str, controls: Controls) -> list[tuple[int, int, bool]]:
    """(start, end, escaped) of the text between markers and of the escaped tokens; markers dropped."""
    pieces: list[tuple[int, int, bool]] = []
    position = 0
    for match in re.finditer(f"{MARK_START}({controls.any.pattern}){MARK_END}|[{MARK_START}{MARK_END}]",
                             text):
        pieces.append((position, match.start(), False))
        if match.group(1) is not None:
            pieces.append((match.start(1), match.end(1), True))
        position = match.end()
    pieces.append((position, len(text), False))
    return pieces


def _encode_piece(hf: Any, piece: str, as_text: bool, newline: list[int],
                  after_newline: bool) -> tuple[list[int], np.ndarray]:
    """(ids, char offsets) of one piece; after the first, encoded behind a "\\n" that is dropped again, so
    a SentencePiece tokenizer adds no prefix space mid-chat (transformers' encode_marked_chat does so)."""
    def encode(text: str) -> tuple[list[int], np.ndarray]:
        out = hf(text, add_special_tokens=False, split_special_tokens=as_text, return_offsets_mapping=True,
                 return_attention_mask=False)
        return list(out["input_ids"]), np.asarray(out["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    if after_newline:
        ids, offsets = encode("\n" + piece)
        if ids[: len(newline)] == newline:
            return ids[len(newline):], np.maximum(offsets[len(newline):] - 1, 0)
    return encode(piece)


def _encode_tiktoken(tok: TextTokenizer, texts: Sequence[str], spans: Sequence[Sequence[Span]],
                     controls: Controls) -> list[EncodedChat | str]:
    layouts = [_tiktoken_pieces(text, controls) for text in texts]
    unique = list(dict.fromkeys(text[start:end] for text, layout in zip(texts, layouts, strict=True)
                                for start, end, token in layout if token is None))
    encoded = dict(zip(unique, tok.backend._tokenizer.encode_ordinary_batch(unique, num_threads=tok.threads),
                       strict=True))
    byte_lengths = _byte_lengths(tok)
    out: list[EncodedChat | str] = []
    for text, layout, row_spans in zip(texts, layouts, spans, strict=True):
        ids: list[int] = []
        mask: list[bool] = []
        for start, end, token in layout:
            piece = [token] if token is not None else encoded[text[start:end]]
            ids += piece
            mask += _piece_mask(text[start:end], start, piece, row_spans, byte_lengths)
        out.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)))
    return out


def _tiktoken_pieces(text: str, controls: Controls) -> list[tuple[int, int, int | None]]:
    """(start, end, control id or None for text) covering the text; markers dropped."""
    pieces: list[tuple[int, int, int | None]] = []
    position = 0
    # Without markers, the pattern of control tokens alone (literals with a common start: fast)
    pattern = controls.cut if _has_marks(text) else controls.bare
    for match in pattern.finditer(text):
        if match.start() > position:
            pieces.append((position, match.start(), None))
        escaped, own = match.groups() if pattern is controls.cut else (None, match.group(1))
        if escaped is not None:  # plain text
            pieces.append((match.start(1), match.end(1), None))
        elif own is not None:
            pieces.append((match.start(), match.end(), controls.ids[own]))
        position = match.end()
    if position < len(text):
        pieces.append((position, len(text), None))
    return pieces


def _piece_mask(piece: str, start: int, ids: list[int], spans: Sequence[Span],
                byte_lengths: np.ndarray) -> list[bool]:
    """In-span mask of one piece's tokens; per-token offsets only for a piece a span boundary cuts."""
    end = start + len(piece)
    cut = [(max(first, start), min(last, end)) for first, last in spans if first < end and last > start]
    if not cut or len(ids) == 1 or any(first == start and last == end for first, last in cut):
        return [bool(cut)] * len(ids)
    lengths = byte_lengths[ids]
    token_ends = np.cumsum(lengths)
    in_bytes = [(len(piece[: first - start].encode()), len(piece[: last - start].encode()))
                for first, last in cut]
    return in_spans(token_ends - lengths, token_ends, in_bytes).tolist()


def _byte_lengths(tok: TextTokenizer) -> np.ndarray:
    """Bytes of every token id of the tiktoken vocabulary (built once per tokenizer)."""
    if "byte_lengths" not in tok.cache:
        encoding = tok.backend._tokenizer
        lengths = np.zeros(encoding.n_vocab, dtype=np.int64)
        for token, rank in tok.backend._mergeable_ranks.items():
            lengths[rank] = len(token)
        for text, (token_id, _) in tok.added_tokens.items():
            lengths[token_id] = len(text.encode())
        tok.cache["byte_lengths"] = lengths
    return tok.cache["byte_lengths"]
