"""Synthetic chat conversations whose token length (tokenizer + Qwen chat template) hits a target exactly.

Text is *learnable*: one fixed "language" of ~200 English words and punctuation, a seeded first-order
Markov chain in which every word has 4 successors with probabilities 0.55/0.25/0.12/0.08 (entropy ~1.1
nats a token, vs ln(151,936) ~ 11.9 for a random Qwen token), so a tiny model's loss drops within a few
steps. The chain is run once into a long word stream; a message's content is a slice of that stream:

    stream text   "the model can see a . the data ..."     one space between words
    offsets        ^0  ^4    ^10 ^14 ...                   char start of each word
    cost_space     [c(" the"), c(" model"), ...]           tokens of " word" under the tokenizer
    cost_first     [c("the"), ...]                         tokens of the word at the start of a content

Calibration (once per tokenizer, ~200 short encodes) measures both costs. With a BPE whose pre-tokenizer
splits at spaces (Qwen, GPT-2 style) the tokens of a slice are additive, so the slice [a, b) of exactly k
tokens is found with one `searchsorted` on the cumulative cost; any shortfall is filled with a one-token
word. No text is tokenized per sample: 10k LMSYS-like conversations take about a second.

A conversation of target length T (chat-template tokens) is laid out as

    [system]? (user, assistant) x turns    T = sum(header_j + content_j),  header: im_start role\\n im_end \\n

with per-distribution shapes: lmsys ~2 turns of ~70 prompt + ~215 response tokens (the LMSYS-Chat-1M
averages), wikipedia one short prompt and a long article, chatqa2 a long user context and a short answer.
Targets shorter than the smallest conversation (one turn, one token each side) are raised to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.data.tokenizer import TextTokenizer

_WORD_TEXT = (
    "the of and to a in is it that was for on are with as be at by this had not but from or have an they "
    "which one you were all we when there can more if out so said what up its about into than them only "
    "other new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three model data train token batch layer memory rank ring "
    "attention sequence bucket plan step loss fast short river stone city music light water green small "
    "house story field paper north south school , ."
)
_WORDS = tuple(_WORD_TEXT.split())
_SUCCESSOR_P = np.array([0.55, 0.25, 0.12, 0.08])
_LANGUAGE_SEED = 20250525  # the language is fixed; data.seed only picks slices and conversation shapes
_STREAM_CHUNK = 1 << 17  # words per chain chunk; slices start in the first half of chunk 0
_SYSTEM_PROMPT = "You are a helpful assistant."
DISTRIBUTIONS = ("lmsys", "wikipedia", "chatqa2")


@dataclass(frozen=True)
class _Shape:
    """Conversation shape of a distribution: turns, per-turn prompt/response weights, system probability."""

    turns: tuple[int, ...]
    turn_p: tuple[float, ...]
    prompt_weight: float
    response_weight: float
    system_p: float


_SHAPES = {
    # LMSYS-Chat-1M averages 2.0 turns of ~70 prompt + ~215 response tokens (docs/design.md §6); these turn
    # probabilities give 1.9, close enough for a length model whose totals are set by the target anyway.
    "lmsys": _Shape((1, 2, 3, 4), (0.45, 0.30, 0.15, 0.10), 70.0, 215.0, 0.2),
    "wikipedia": _Shape((1,), (1.0,), 3.0, 97.0, 0.0),
    "chatqa2": _Shape((1, 2), (0.8, 0.2), 93.0, 7.0, 0.5),
}


class ConversationSynth:
    """Generates conversations of exact token lengths for one tokenizer (see module docstring)."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok = tok
        im_start, im_end = tok.require_chat_ids()
        self._vocab = np.array(_WORDS)
        counts = tok.encode_batch([" " + w for w in _WORDS] + list(_WORDS))
        self._cost_space_word = np.array([len(c) for c in counts[: len(_WORDS)]], dtype=np.int64)
        self._cost_first_word = np.array([len(c) for c in counts[len(_WORDS):]], dtype=np.int64)
        cheap = np.flatnonzero(self._cost_space_word == 1)
        # Filler that tops up a slice to the exact length; "the" is one token in every BPE seen.
        self._filler = str(self._vocab[cheap[0]]) if len(cheap) else None
        newline = len(tok.encode("\n"))
        self._header = {role: 2 + len(tok.encode(f"{role}\n")) + newline
                        for role in ("system", "user", "assistant")}
        self._system_cost = len(tok.encode(_SYSTEM_PROMPT))
        self._build_stream(_STREAM_CHUNK)

    # ------------------------------------------------------------------------------------------ stream
    def _build_stream(self, num_words: int) -> None:
        """Run the Markov chain for num_words words; keep the text, char offsets and cumulative costs.

        The chain is drawn in fixed chunks, each from its own seeded generator, so a longer stream
        extends a shorter one: a slice's text never depends on how long the stream happens to be.
        """
        successors = np.random.default_rng(_LANGUAGE_SEED).integers(
            0, len(_WORDS), size=(len(_WORDS), len(_SUCCESSOR_P)))
        num_chunks = -(-num_words // _STREAM_CHUNK)
        picks = np.concatenate([
            np.random.default_rng([_LANGUAGE_SEED, chunk]).choice(
                len(_SUCCESSOR_P), _STREAM_CHUNK, p=_SUCCESSOR_P)
            for chunk in range(num_chunks)
        ])
        word_ids = np.empty(len(picks), dtype=np.int64)
        current = 0
        for i, pick in enumerate(picks.tolist()):  # sequential by nature; ~0.1 s per 2^17 words
            current = successors[current, pick]
            word_ids[i] = current
        words = self._vocab[word_ids]
        lengths = np.char.str_len(words) + 1
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])  # offsets[n] = len(text) + 1
        self._text = " ".join(words.tolist())
        self._word_ids = word_ids
        self._cum_space = np.concatenate([[0], np.cumsum(self._cost_space_word[word_ids])])

    def content(self, rng: np.random.Generator, tokens: int) -> str:
        """A stream slice of exactly `tokens` tokens (short by < one word's cost if no filler exists)."""
        if tokens <= 0:
            return ""
        start = int(rng.integers(0, _STREAM_CHUNK // 2))
        if len(self._word_ids) < start + tokens + 1:  # every word costs >= 1 token: this many suffice
            self._build_stream(max(start + tokens + 1, 2 * len(self._word_ids)))
        first = int(self._cost_first_word[self._word_ids[start]])
        # cost of [start, stop) = first + cum[stop] - cum[start + 1]; find the largest stop within budget
        goal = tokens - first + self._cum_space[start + 1]
        stop = int(np.searchsorted(self._cum_space, goal, side="right")) - 1
        if stop <= start:  # even the first word is too long for this budget
            return self._filler_text(tokens, leading=False)
        text = self._text[self._offsets[start]: self._offsets[stop] - 1]
        got = first + int(self._cum_space[stop] - self._cum_space[start + 1])
        return text + self._filler_text(tokens - got, leading=True)

    def _filler_text(self, tokens: int, leading: bool) -> str:
        if tokens <= 0 or self._filler is None:
            return ""
        words = " ".join([self._filler] * tokens)
        return " " + words if leading else words

    # ------------------------------------------------------------------------------------ conversations
    def min_length(self) -> int:
        """Shortest conversation: one user and one assistant message of one token each."""
        return self._header["user"] + self._header["assistant"] + 2

    def conversation(self, rng: np.random.Generator, target: int, dist: str) -> list[dict[str, str]]:
        """One conversation of `target` chat-template tokens (raised to min_length()) shaped like `dist`."""
        shape = _SHAPES[dist]
        target = max(int(target), self.min_length())
        turns = int(rng.choice(shape.turns, p=shape.turn_p))
        use_system = bool(rng.random() < shape.system_p)
        pair = self._header["user"] + self._header["assistant"] + 2
        system = self._header["system"] + self._system_cost
        while turns > 1 and turns * pair + use_system * system > target:
            turns -= 1
        if use_system and turns * pair + system > target:
            use_system = False
        budget = target - turns * (self._header["user"] + self._header["assistant"])
        budget -= system if use_system else 0
        jitter = rng.lognormal(0.0, 0.5, size=2 * turns)
        weights = np.tile([shape.prompt_weight, shape.response_weight], turns) * jitter
        sizes = self._split(budget, weights)
        messages = [{"role": "system", "content": _SYSTEM_PROMPT}] if use_system else []
        for j, size in enumerate(sizes.tolist()):
            role = "user" if j % 2 == 0 else "assistant"
            messages.append({"role": role, "content": self.content(rng, size)})
        return messages

    @staticmethod
    def _split(budget: int, weights: np.ndarray) -> np.ndarray:
        """Integer sizes >= 1 summing to budget, proportional to weights (remainder to the last one)."""
        spare = budget - len(weights)
        sizes = 1 + np.floor(spare * weights / weights.sum()).astype(np.int64)
        sizes[-1] += budget - int(sizes.sum())
        return sizes


def conversation_rng(seed: int, sample_id: int) -> np.random.Generator:
    """Per-sample generator: a sample's conversation depends only on (seed, sample_id), not on batching."""
    return np.random.default_rng([seed, sample_id])


def synth_conversations(synth: ConversationSynth, sample_ids: np.ndarray, targets: np.ndarray,
                        dist: str, seed: int) -> list[list[dict[str, str]]]:
    """Conversations for the given sample ids and target lengths (tokens after the chat template)."""
    if dist not in _SHAPES:
        raise ValueError(f"data.distribution={dist!r} is not one of: {', '.join(DISTRIBUTIONS)}")
    return [synth.conversation(conversation_rng(seed, int(i)), int(t), dist)
            for i, t in zip(sample_ids.tolist(), targets.tolist(), strict=True)]


def target_lengths(dist: str, num_samples: int, seed: int, length_scale: float) -> np.ndarray:
    """The scheduler's length distribution times length_scale, rounded; lengths >= 1 token."""
    from scheduling import sample_lengths

    lengths = np.asarray(sample_lengths(dist, num_samples, seed), dtype=np.float64)
    return np.maximum(1, np.rint(lengths * length_scale)).astype(np.int64)
