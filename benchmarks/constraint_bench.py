"""What constrained decoding costs inside the batched step (runtime_metal/batch.py with
runtime_metal/constraint.py), one JSON:

    python benchmarks/constraint_bench.py [--artifact DIR] [--engine onnxruntime|mlx] [-n 64]

- mask cost per token against the decode step, at batch 1 and 8: every row constrained by a
  JSON schema; the wall time inside the grammar (masks computed and applied, tokens
  committed) per step and per constrained token, beside the step's own time with no row
  constrained (same prompts, greedy). The batched mode (MLX) fills a step's masks together on
  llguidance's threads (constraint.fill_masks), so a step pays about one row's mask there; the
  rows mode (onnxruntime) masks each row's logits on the host in turn;
- aggregate throughput at 8 streams with half the rows constrained against none: tokens/s over
  all rows for -n steps. A constrained row whose document is complete starts the grammar over
  (every step of it pays the mask); no row stops at EOS.

Each figure is the median of -r rounds after a warm-up round. The model: --artifact (with its
tokenizer), default the bundled SmolLM2-135M-Instruct GGUF converted once into --work with
the default conversion (its Q4_1 blocks kept).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import fuselm.runtime_metal.batch as batch_module
from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.constraint import TokenConstraint, json_schema_grammar
from fuselm.runtime_metal.loaded_model import LoadedModel, open_model
from fuselm.runtime_metal.sampling import SamplingOptions
from fuselm.runtime_metal.tokenizer import encode_prompt

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
QUESTIONS = ["Describe a person as JSON.", "Give me a user record.", "Who is the admin?",
             "Invent a character.", "Describe a guest.", "Make up a profile.",
             "Tell me about a user.", "Describe someone you know."]


class TimedConstraint(TokenConstraint):
    """A TokenConstraint that adds the seconds it spends (mask on the host + advance) to
    `spent` (the batched mode's masks, made for all rows at once, are timed by timed_fills), and
    starts its grammar over once a document is complete (the row goes on decoding in grammar,
    as the next request on that row would, with no prefill between)."""

    spent: list[float]
    tokens: list[int]
    vocab: Any
    grammar: str

    def mask(self, logits):  # noqa: ANN001, ANN201
        t0 = time.perf_counter()
        out = super().mask(logits)
        self.spent[0] += time.perf_counter() - t0
        return out

    def advance(self, token: int) -> None:
        t0 = time.perf_counter()
        super().advance(token)
        self.spent[0] += time.perf_counter() - t0
        self.tokens[0] += 1
        if self.done:  # a new request's grammar state (its compile is not a per-token cost)
            TokenConstraint.__init__(self, self.vocab, self.grammar)


def timed_fills(spent: list[float]) -> None:
    """The batch decoder's mask filling (all constrained rows of a step at once, on
    llguidance's threads) adding its seconds to `spent`."""
    inner = batch_module.fill_masks

    def fill_masks(rows, bits):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        inner(rows, bits)
        spent[0] += time.perf_counter() - t0

    batch_module.fill_masks = fill_masks


def artifact(args: argparse.Namespace) -> Path:
    if args.artifact:
        return args.artifact
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.converter.pipeline import ConvertOptions, convert

    out = args.work / "smollm2"
    if not (out / "fuselm.json").is_file():
        convert(bundled_gguf(), out, ConvertOptions())
    return out


SPENT = [0.0]  # seconds inside the grammar: masks (host or batched) and advances
timed_fills(SPENT)


def run(model: LoadedModel, dec: BatchDecoder, prompts: list[list[int]],
        constrained: list[bool], steps: int) -> dict[str, float]:
    """`steps` batched steps over the prompts' rows; returns wall seconds, tokens, and the
    seconds and tokens inside the grammar."""
    grammar = json_schema_grammar(SCHEMA)
    spent, counted = SPENT, [0]

    def constraint() -> TokenConstraint:
        c = TimedConstraint(model_vocab(model), grammar)
        c.spent, c.tokens, c.vocab, c.grammar = spent, counted, model_vocab(model), grammar
        return c

    greedy = SamplingOptions()
    slots = [dec.add(p, greedy, constraint=constraint() if c else None)
             for p, c in zip(prompts, constrained, strict=True)]
    dec.step()  # the first tokens (from the prompts' prefill): not a decode step
    spent[0], counted[0] = 0.0, 0
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens += len(dec.step())
    wall = time.perf_counter() - t0
    for slot in slots:
        dec.remove(slot)
    return {"wall_s": wall, "tokens": tokens, "grammar_s": spent[0], "grammar_tokens": counted[0]}


def model_vocab(model: LoadedModel) -> Any:
    from fuselm.runtime_metal.constraint import constraint_vocab

    return constraint_vocab(model.tokenizer, model.manifest.model.vocab_size, model.eos_ids)


def median_runs(fn, rounds: int) -> list[dict[str, float]]:  # noqa: ANN001
    return [fn() for _ in range(rounds + 1)][1:]


def progress(what: str, since: float) -> None:
    """A phase's end on stderr (the JSON goes to stdout at the end): where a run's time went."""
    print(f"[constraint_bench] {what}: {time.perf_counter() - since:.1f} s", file=sys.stderr,
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_constraint_bench"))
    ap.add_argument("--engine", default="onnxruntime")
    ap.add_argument("-n", type=int, default=48, help="steps per round")
    ap.add_argument("-r", type=int, default=3, help="rounds (median)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = open_model(artifact(args), args.engine)
    progress("model converted and opened", t0)
    prompts = [encode_prompt(model.tokenizer, q) for q in QUESTIONS]
    dec = BatchDecoder(model.engine, max_batch=8, max_context=512)
    model_vocab(model)  # built once, outside the timings
    progress("tokenizer's vocabulary for the grammar", t0)
    out: dict[str, Any] = {"bench": "constraint", "engine": args.engine, "mode": dec.mode,
                           "vocab": model.manifest.model.vocab_size, "steps": args.n,
                           "machine": platform.machine(), "schema": SCHEMA}
    for b in (1, 8):
        free = median_runs(lambda b=b: run(model, dec, prompts[:b], [False] * b, args.n), args.r)
        shaped = median_runs(lambda b=b: run(model, dec, prompts[:b], [True] * b, args.n),
                             args.r)
        progress(f"batch {b}", t0)
        step_ms = statistics.median(r["wall_s"] / args.n for r in free) * 1e3
        per_token_us = statistics.median(r["grammar_s"] / max(r["grammar_tokens"], 1)
                                         for r in shaped) * 1e6
        per_step_ms = statistics.median(r["grammar_s"] / args.n for r in shaped) * 1e3
        out[f"b{b}"] = {"step_ms_unconstrained": round(step_ms, 3),
                        "step_ms_all_constrained": round(statistics.median(
                            r["wall_s"] / args.n for r in shaped) * 1e3, 3),
                        "mask_us_per_token": round(per_token_us, 1),
                        "mask_ms_per_step": round(per_step_ms, 3),
                        "mask_pct_of_step": round(100 * per_step_ms / step_ms, 2)}
    half = [i % 2 == 0 for i in range(8)]
    none = median_runs(lambda: run(model, dec, prompts, [False] * 8, args.n), args.r)
    some = median_runs(lambda: run(model, dec, prompts, half, args.n), args.r)
    tok_s_none = statistics.median(r["tokens"] / r["wall_s"] for r in none)
    tok_s_half = statistics.median(r["tokens"] / r["wall_s"] for r in some)
    out["b8_throughput"] = {"tok_s_none_constrained": round(tok_s_none, 1),
                            "tok_s_half_constrained": round(tok_s_half, 1),
                            "ratio": round(tok_s_half / tok_s_none, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
