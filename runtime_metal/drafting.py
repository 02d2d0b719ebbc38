"""Drafters for speculative decoding: cheap guesses of the next tokens, which the model checks
in one step (generate.py's speculative loop, batch.py's speculative step).

    drafter.propose(tokens, k, key) -> up to k token ids expected to follow `tokens`

`tokens` is everything the sequence holds so far (prompt, reply, and the token about to be
fed); `key` names the sequence (a batch slot; 0 for a single generation), so a drafter with
state keeps one per sequence. A wrong guess costs only the positions the check rejects: the
output is the model's own greedy tokens either way (generate.accept_drafts).

Two drafters:
- `PromptLookup` (prompt lookup decoding, HF's `prompt_lookup_num_tokens`, llama.cpp's
  lookup decoding): the last n tokens (n = max_ngram down to min_ngram) are searched for in
  the sequence itself, and the tokens that followed their most recent earlier occurrence are
  the draft. No second model: it pays off where the reply repeats its input (a document or
  code revised, a quote, an extraction).
- `DraftModel`: a smaller fuselm artifact with the same tokenizer (`--draft OUT_DIR`) decodes
  k tokens greedily on its own engine; its KV cache per sequence is kept and trimmed to what
  the sequence still shares with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fuselm.runtime_metal.engine import Engine
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.generate import Drafter, prefill
from fuselm.runtime_metal.prefix import common_prefix

if TYPE_CHECKING:
    from fuselm.runtime_metal.loaded_model import LoadedModel

DEFAULT_MAX_NGRAM = 3  # longest n-gram prompt lookup matches (HF's default is 2)


class PromptLookup:
    """Drafts from the sequence itself: the tokens after the most recent earlier occurrence of
    its last n tokens, for the longest n in [min_ngram, max_ngram] that occurs. The most
    recent occurrence, not the first (HF's choice): in a revision it is the passage being
    copied, where a common n-gram's first occurrence is anywhere. An index of n-gram ->
    latest start is kept per sequence and extended by the new tokens only."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise RuntimeUserError(
                f"the prompt lookup n-gram size must be >= 1, got {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # key -> (tokens indexed, n-gram -> start of its latest occurrence that has a
        # continuation)
        self._index: dict[int, tuple[list[int], dict[tuple[int, ...], int]]] = {}

    def propose(self, tokens: Sequence[int], k: int, key: int = 0) -> list[int]:
        seq, index = self._index.get(key, ([], {}))
        if len(seq) > len(tokens) or seq != list(tokens[:len(seq)]):
            seq, index = [], {}  # another sequence in this slot
        start = len(seq)
        seq = list(tokens)
        # an n-gram starting at i is indexed once the token after it exists (i + n < len)
        for n in range(self.min_ngram, self.max_ngram + 1):
            for i in range(max(start - n, 0), len(seq) - n):
                index[tuple(seq[i:i + n])] = i
        self._index[key] = (seq, index)
        if k < 1:
            return []
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            at = index.get(tuple(seq[-n:]))
            if at is not None:
                return seq[at + n:at + n + k]
        return []


class DraftModel:
    """A smaller model on its own engine drafts k tokens greedily. One KV cache per sequence
    key, trimmed to the prefix the sequence still shares with what it fed (a rejected draft
    is forgotten, the accepted part kept)."""

    name = "draft-model"

    def __init__(self, engine: Engine, vocab_size: int) -> None:
        self.engine = engine
        self.vocab_size = vocab_size  # the target's: a draft id past it is never proposed
        self._states: dict[int, tuple[Any, list[int]]] = {}

    def propose(self, tokens: Sequence[int], k: int, key: int = 0) -> list[int]:
        if k < 1 or not tokens:
            return []
        engine = self.engine
        state, fed = self._states.get(key, (None, []))
        saved = engine.swap_cache(state)
        out: list[int] = []
        known: list[int] = []  # what the cache holds when the call ends (nothing on an error)
        try:
            keep = min(common_prefix(fed, tokens), len(tokens) - 1)
            engine.trim(engine.offset - keep)
            engine.reserve(len(tokens) + k)
            logits = prefill(engine, tokens[keep:])
            while True:
                token = int(np.argmax(np.asarray(logits, np.float32)))
                if token >= self.vocab_size:
                    break
                out.append(token)
                if len(out) == k:
                    break
                logits = engine.decode_step(token)
            known = [*tokens, *out][:engine.offset]
        finally:
            self._states[key] = (engine.swap_cache(saved), known)
        return out


def check_same_tokenizer(target: Path, draft: Path, target_vocab: int, draft_vocab: int
                         ) -> None:
    """A draft model must speak the target's token ids: the same tokenizer (tokenizer.json's
    vocabulary, merges and added tokens), and no larger a vocabulary. One error line else."""
    def vocab_of(folder: Path) -> dict[str, Any] | None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RuntimeUserError(f"cannot read {path}: {e}") from None
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
        return {"model": data.get("model"), "added": added}

    mine, theirs = vocab_of(target), vocab_of(draft)
    if mine is None or theirs is None:
        which = target if mine is None else draft
        raise RuntimeUserError(
            f"the draft model needs both artifacts' tokenizers to compare; {which} has no "
            "tokenizer.json")
    if mine != theirs or draft_vocab > target_vocab:
        raise RuntimeUserError(
            f"the draft model {draft} has another tokenizer than {target} (vocabulary "
            f"{draft_vocab} vs {target_vocab} ids); give a draft model of the same tokenizer")


def speculative_engine_options(engine_name: str, options: dict[str, Any], drafting: bool
                               ) -> dict[str, Any]:
    """The target engine's options when speculative decoding is on (`drafting`): on
    onnxruntime, `exact_rows` unless `options` set it (None: on where the lowered graph runs,
    ort_engine/engine.py). At accuracy level 4 the default engine's check of several tokens
    rounds unlike its one-token steps, so which drafts were kept would decide the reply; with
    exact rows every position is computed alike, so the reply is one fixed greedy decoding
    (plain decoding's with exact rows), whatever was drafted, at no cost to the speculative
    steps (BENCHMARKS.md 'Speculative decoding'). Plain decoding keeps the one-row path."""
    if drafting and engine_name == "onnxruntime" and "exact_rows" not in options:
        return {**options, "exact_rows": None}
    return options


def speculative_options(target: LoadedModel, *, draft: str | Path | None = None,
                        lookup: bool = False, num_draft: int | None = None,
                        max_ngram: int | None = None, **engine_options: Any
                        ) -> dict[str, Any]:
    """The generation options (drafter, num_draft) of speculative decoding as the CLI's flags
    and the API's keywords ask for it, or {} for none: prompt lookup (`lookup`), or a draft
    artifact `draft` opened on the target's engine kind with `engine_options`, its tokenizer
    checked against the target's. A setting without a drafter, or both drafters, is one
    error line."""
    from fuselm.runtime_metal.generate import DEFAULT_NUM_DRAFT
    from fuselm.runtime_metal.loaded_model import open_model

    if lookup and draft is not None:
        raise RuntimeUserError("give one drafter: --draft-lookup or --draft, not both")
    if not lookup and draft is None:
        for flag, value in (("--num-draft", num_draft), ("--draft-ngram", max_ngram)):
            if value is not None:
                raise RuntimeUserError(f"{flag} sets speculative decoding; add --draft-lookup "
                                       "or --draft OUT_DIR")
        return {}
    if num_draft is not None and num_draft < 1:
        raise RuntimeUserError(f"--num-draft must be >= 1, got {num_draft}")
    drafter: Drafter
    if lookup:
        drafter = PromptLookup(max_ngram or DEFAULT_MAX_NGRAM)
    else:
        if max_ngram is not None:
            raise RuntimeUserError("--draft-ngram sets --draft-lookup's n-grams; a --draft "
                                   "model takes none")
        folder = Path(draft)  # type: ignore[arg-type]
        if not (folder / "fuselm.json").is_file():
            raise RuntimeUserError(f"--draft {folder}: not a fuselm artifact (no fuselm.json); "
                                   "convert the draft model first")
        # the draft model's rounding never reaches the reply: it decodes on the one-row path
        small = open_model(folder, target.engine_name, defer_engine=True,
                           **{k: v for k, v in engine_options.items() if k != "exact_rows"})
        check_same_tokenizer(target.path, folder, target.manifest.model.vocab_size,
                             small.manifest.model.vocab_size)
        drafter = DraftModel(small.engine, target.manifest.model.vocab_size)
    return {"drafter": drafter, "num_draft": num_draft or DEFAULT_NUM_DRAFT}
