"""Constrained decoding: a grammar (a JSON schema, any JSON object, a tool call's wrapper around
its arguments) restricts each step's token choice, per sequence, with llguidance.

    vocab = constraint_vocab(tokenizer, vocab_size, eos_ids)   # once per tokenizer (~0.3 s)
    grammar = json_schema_grammar(schema)                       # ConstraintError names a problem
    c = TokenConstraint(vocab, grammar)                         # one per request
    sampler = constrained(make_sampler(opts), c)                # masks, then samples, then commits

Why llguidance (benchmarks/grammar_libs.py, BENCHMARKS.md 'Constrained decoding'): it covered
every keyword case the benchmark tries where xgrammar was over-strict on patternProperties and
outlines-core ignored exclusiveMinimum and multipleOf; it refuses an unsupported keyword with a
message (the server's 400) instead of constraining something else; its mask costs ~20-35 us a
row on SmolLM2's 49k vocabulary (xgrammar's ~5 us), under 1 % of a CPU decode step; and it is
one dependency-free wheel that imports in 0.06 s (xgrammar imports torch: 3 s, 280 MB).

The mask is applied on the host to one row's logits: a disallowed token gets the lowest finite
float32 (not -inf), so the sampler's NaN/Inf check still sees only what the model produced.
Once the grammar is complete the mask allows only the end of sequence, so the reply stops there.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.sampling import Sampler, check_finite

# How generated JSON is laid out: one space after ':' and ',' (what chat models write), no
# free whitespace (a weak model would otherwise pad with newlines until max_tokens).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MASKED = np.finfo(np.float32).min


class ConstraintError(RuntimeUserError):
    """A schema or grammar that cannot constrain decoding; the message names the problem."""


def _check(grammar: str, what: str) -> str:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ConstraintError(f"{what}: {error.strip()}")
    return grammar


def json_schema_grammar(schema: Any, what: str = "the JSON schema") -> str:
    """The grammar of JSON documents valid against `schema` (a dict, or its JSON text)."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"{what} is not valid JSON ({e.msg} at line {e.lineno} "
                                  f"column {e.colno})") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ConstraintError(f"{what} must be a JSON object, not {type(schema).__name__}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise ConstraintError(f"{what}: {e}") from None
    return _check(grammar, what)


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format json_object)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str, what: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
    from llguidance import LLMatcher

    return _check(LLMatcher.grammar_from_lark(lark), what)


_VOCABS: dict[int, tuple[Any, Any]] = {}
_VOCABS_LOCK = threading.Lock()


def constraint_vocab(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of `tokenizer` (a transformers fast tokenizer) over the model's
    `vocab_size` logits, ending at any of `eos_ids`; built once per tokenizer object."""
    import llguidance.hf

    with _VOCABS_LOCK:
        held = _VOCABS.get(id(tokenizer))
        if held is not None and held[0] is tokenizer:
            return held[1]
        try:
            vocab = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                 eos_token=[int(e) for e in eos_ids])
        except ValueError as e:
            raise ConstraintError(f"this model's tokenizer cannot constrain decoding ({e})"
                                  ) from None
        _VOCABS[id(tokenizer)] = (tokenizer, vocab)
        return vocab


class TokenConstraint:
    """One sequence's grammar state: `mask` the next step's logits, `advance` by the token
    chosen. Not shared between sequences (each request makes its own)."""

    def __init__(self, vocab: Any, grammar: str) -> None:
        from llguidance import LLMatcher

        self._matcher = LLMatcher(vocab, grammar)
        if self._matcher.is_error():
            raise ConstraintError(f"the grammar cannot be used: {self._matcher.get_error()}")
        self._words = (vocab.vocab_size + 31) // 32
        self._bits = np.empty(self._words, np.int32)

    @property
    def matcher(self) -> Any:
        """llguidance's LLMatcher of this sequence (fill_masks hands it to the thread pool)."""
        return self._matcher

    @property
    def words(self) -> int:
        """int32 words a mask takes: ceil(vocab / 32)."""
        return self._words

    def fill(self, bits: np.ndarray) -> None:
        """Write the next token's mask into `bits`, int32 [ceil(vocab / 32)], C-contiguous:
        bit t % 32 of word t // 32 set when token t is allowed."""
        assert bits.dtype == np.int32 and bits.size == self._words and bits.flags.c_contiguous
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row's logits [vocab] with every token the grammar refuses at MASKED."""
        self.fill(self._bits)
        n = logits.shape[-1]
        allowed = np.unpackbits(self._bits.view(np.uint8), count=n, bitorder="little")
        out = np.full(n, MASKED, np.float32)
        np.copyto(out, logits, where=allowed.view(np.bool_))  # 0/1 bytes read as bools
        return out

    def advance(self, token: int) -> None:
        if self._matcher.is_stopped():  # the end of sequence after a complete document
            return
        if not self._matcher.consume_token(int(token)) or self._matcher.is_error():
            raise RuntimeError(f"the grammar refused token {token} its own mask allowed: "
                               f"{self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete (only the end of sequence may follow)."""
        return self._matcher.is_stopped()


# llguidance's default pool size: 80 % of the CPUs, at most 32. A machine with fewer than
# three CPUs fills row by row: there the pool gains nothing (benchmarks/probes/mask_fill.py on
# 2 shared cores, a pool of 2: 8 rows 102 us a step against 93 row by row, 16 rows 174 / 197).
POOL_THREADS = min(32, (os.cpu_count() or 1) * 4 // 5)
_EXECUTORS: dict[int, Any] = {}
_EXECUTORS_LOCK = threading.Lock()


def _executor(threads: int) -> Any:
    """llguidance's thread pool of `threads` threads, made once."""
    from llguidance import LLExecutor

    with _EXECUTORS_LOCK:
        if threads not in _EXECUTORS:
            _EXECUTORS[threads] = LLExecutor(num_threads=threads)
        return _EXECUTORS[threads]


def fill_masks(rows: Sequence[tuple[TokenConstraint, int]], bits: np.ndarray,
               threads: int = POOL_THREADS) -> None:
    """Each (constraint, r): its next token's mask into row r of `bits`, int32 [rows, words]
    C-contiguous (TokenConstraint.fill's layout). With `threads` ≥ 2 several constraints are
    filled at once on llguidance's threads, outside the GIL, so a step's masks cost about
    one row's where there are cores for them; else (and for one row) row by row."""
    assert bits.dtype == np.int32 and bits.ndim == 2 and bits.flags.c_contiguous
    if len(rows) == 1 or threads < 2:
        for constraint, r in rows:
            constraint.fill(bits[r])
        return
    for constraint, _ in rows:
        assert bits.shape[1] == constraint.words
    _executor(threads).unsafe_compute_mask_ptr([(c.matcher, r) for c, r in rows],
                                               bits.ctypes.data, bits.strides[0], bits.shape[0])


def constrained(sampler: Sampler, constraint: TokenConstraint) -> Sampler:
    """`sampler` choosing among the tokens `constraint` allows, advancing it by each choice."""

    def sample(logits: np.ndarray, history: Sequence[int]) -> int:
        check_finite(logits)  # before the mask: the model's own values
        token = sampler(constraint.mask(np.asarray(logits, np.float32)), history)
        constraint.advance(token)
        return token

    return sample
