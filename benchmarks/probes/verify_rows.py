"""Why a speculative check of s tokens computes unlike s one-token steps on onnxruntime's
lowered graph at accuracy level 4, and what the engine's `exact_rows` option costs.

    python benchmarks/probes/verify_rows.py [--artifact DIR] [--work /tmp/fuselm_verify_rows]
        [--contexts 268 768] [--reps 40]

On SmolLM2-135M-Instruct (the bundled Q4_1 GGUF, default conversion; or --artifact), after a
~270-token edit prompt:
- `nodes`: the lowered graph's first nodes, each output of a 4-token step against the same
  four tokens fed one by one (max |difference|, and the output's scale): the last node alike,
  the first that differs (where the several-row computation parts from the one-row one), the
  first whose difference is over 1e-4 of its scale (where it is amplified), and the logits;
- `logits`: max |logit difference| of a check of s tokens against s decode steps, and of a
  prefilled prompt against its last 5 tokens decoded, with exact_rows off and on;
- `step_cost`: one decode step's CPU time (process_time: all threads) and wall time with
  exact_rows off and on, interleaved, medians over --reps groups of 4 steps, at each context.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

CODE = '''def area(shape, w, h=None):
    """The area of a rectangle, a square or a triangle."""
    if shape == "square":
        return w * w
    if shape == "rectangle":
        if h is None:
            raise ValueError("a rectangle needs a height")
        return w * h
    if shape == "triangle":
        if h is None:
            raise ValueError("a triangle needs a height")
        return w * h / 2
    raise ValueError(f"unknown shape {shape}")


def total_area(shapes):
    total = 0
    for shape, w, h in shapes:
        total += area(shape, w, h)
    return total


def largest(shapes):
    best = None
    for shape, w, h in shapes:
        a = area(shape, w, h)
        if best is None or a > best[0]:
            best = (a, shape)
    return best
'''
PROMPT = ("Rewrite this Python code with the function `area` renamed to `shape_area` "
          "everywhere. Reply with the whole code only.\n\n```python\n" + CODE + "```")


def artifact(work: Path) -> Path:
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.converter.pipeline import ConvertOptions, convert

    out = work / "smollm2_default"
    if not (out / "fuselm.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        convert(bundled_gguf(), out, ConvertOptions.from_flags())
    return out


def nodes(art: Path, ids: list[int], first: int = 60) -> list[dict]:
    """Outputs of the first `first` activation nodes of the default lowered graph: a 4-token
    step against 4 one-token steps after the prompt."""
    import onnx
    import onnxruntime as ort

    from fuselm.runtime_metal.artifact import model_path, read_manifest
    from fuselm.runtime_metal.graph_io import PAST, present_for
    from fuselm.runtime_metal.ort_engine.lowering import lower_for_cpu
    from fuselm.runtime_metal.ort_engine.session import make_session
    from fuselm.runtime_metal.ort_engine.shared_kv import SharedKV

    manifest = read_manifest(art)
    low = lower_for_cpu(model_path(art), manifest)
    assert not isinstance(low, str), low
    g = low.model.graph
    typed = {v.name: v.type.tensor_type.elem_type
             for v in onnx.shape_inference.infer_shapes(low.model).graph.value_info}
    live = {i.name for i in g.input}
    probed: list[tuple[str, str]] = []
    for n in g.node:  # topological order: the nodes that depend on the inputs, in turn
        if not any(i in live for i in n.input):
            continue
        live.update(n.output)
        for o in n.output:
            if (o and not PAST.match(o) and not o.startswith(("present", "lower/"))
                    and n.op_type != "Shape"
                    and typed.get(o, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT):
                g.output.append(onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT,
                                                                   None))
                probed.append((o, n.op_type))
        if len(probed) >= first:
            break
    session, _ = make_session(low.model.SerializeToString(), accuracy_level=4,
                              external_data_dir=art, initializers=low.memory_values)
    inputs = {i.name for i in session.get_inputs()}
    past = sorted(n for n in inputs if PAST.match(n))
    kv = SharedKV(past, manifest.model.num_kv_heads, manifest.model.head_dim)
    kv.reserve(len(ids) + 16)

    def run(tokens: list[int]) -> dict[str, np.ndarray]:
        s, start = len(tokens), kv.offset
        binding = session.io_binding()
        feeds = {"input_ids": np.array([tokens], np.int64),
                 "attention_mask": np.ones((1, start + s), np.int64),
                 "position_ids": np.arange(start, start + s, dtype=np.int64)[None],
                 "logits_from": np.zeros(1, np.int64)}
        for name, value in feeds.items():
            if name in inputs:
                binding.bind_cpu_input(name, value)
        names = ["logits"] + [o for o, _ in probed]
        for name in names:
            binding.bind_output(name)
        for name, buf in kv.buffers.items():
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(present_for(name), value)
        session.run_with_iobinding(binding)
        kv.offset = start + s
        values = binding.get_outputs()[:len(names)]  # then the KV buffers bound after them
        return dict(zip(names, (v.numpy() for v in values), strict=True))

    run(ids)
    tokens = ids[-4:]
    whole = run(tokens)
    kv.trim(4)
    single = [run([t]) for t in tokens]
    rows = []
    for name, op in [*probed, ("logits", "")]:
        got = whole[name]
        one = np.concatenate([r[name] for r in single], axis=1)  # [1, s, ...]
        rows.append({"op": op, "output": name, "max_diff": float(np.abs(got - one).max()),
                     "scale": float(np.abs(one).max())})
    return rows


def first_differing(rows: list[dict]) -> list[dict]:
    """The last node computed alike, the first that differs, the first whose difference
    exceeds 1e-4 of its scale (where it is amplified), and the logits."""
    at = next((i for i, r in enumerate(rows) if r["max_diff"]), len(rows) - 1)
    big = next((r for r in rows[at:-1] if r["max_diff"] > 1e-4 * r["scale"]), None)
    return [*rows[max(at - 1, 0):at + 1], *([big] if big else []), rows[-1]]


def logits(art: Path, ids: list[int]) -> dict[str, dict]:
    from fuselm.runtime_metal.generate import prefill
    from fuselm.runtime_metal.loaded_model import open_model

    out = {}
    for exact in (False, True):
        engine = open_model(art, "onnxruntime", exact_rows=exact).engine
        engine.reserve(len(ids) + 16)
        whole = prefill(engine, ids)
        tokens = [int(np.argmax(whole))]
        for _ in range(7):
            tokens.append(int(np.argmax(engine.decode_step(tokens[-1]))))
        engine.trim(7)
        checks = {}
        for s in (2, 4, 8):
            checked = engine.verify(np.array([tokens[:s]], np.int64))
            engine.trim(s)
            stepped = np.stack([engine.decode_step(t) for t in tokens[:s]])
            engine.trim(s)
            checks[s] = float(np.abs(checked - stepped).max())
        engine.reset()
        engine.reserve(len(ids) + 16)
        prefill(engine, ids[:-5])
        for t in ids[-5:]:
            last = engine.decode_step(t)
        out[f"exact_rows={exact}"] = {"check_vs_steps": checks,
                                      "prefill_vs_decoded": float(np.abs(last - whole).max())}
    return out


def step_cost(art: Path, ids: list[int], contexts: list[int], reps: int) -> dict[str, dict]:
    from fuselm.runtime_metal.generate import prefill
    from fuselm.runtime_metal.loaded_model import open_model

    engines = {e: open_model(art, "onnxruntime", exact_rows=e).engine for e in (False, True)}
    out = {}
    for ctx in contexts:
        prompt = (ids * (ctx // len(ids) + 1))[:ctx]
        for engine in engines.values():
            engine.reset()
            engine.reserve(ctx + 8)
            prefill(engine, prompt)
        cpu: dict[bool, list[float]] = {False: [], True: []}
        wall: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(reps):
            for exact in ((False, True) if rep % 2 else (True, False)):
                engine = engines[exact]
                c, w = time.process_time(), time.perf_counter()
                for _ in range(4):
                    engine.decode_step(ids[-1])
                cpu[exact].append((time.process_time() - c) / 4 * 1e3)
                wall[exact].append((time.perf_counter() - w) / 4 * 1e3)
                engine.trim(4)
        med = {e: (statistics.median(cpu[e]), statistics.median(wall[e])) for e in cpu}
        out[str(ctx)] = {
            "cpu_ms": {"default": round(med[False][0], 2), "exact_rows": round(med[True][0], 2)},
            "wall_ms": {"default": round(med[False][1], 2), "exact_rows": round(med[True][1], 2)},
            "cpu_ratio": round(med[True][0] / med[False][0], 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_verify_rows"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[268, 768])
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()

    from fuselm.runtime_metal.loaded_model import open_model
    from fuselm.runtime_metal.tokenizer import encode_prompt

    art = args.artifact or artifact(args.work)
    ids = encode_prompt(open_model(art, "onnxruntime", defer_engine=True).tokenizer, PROMPT)
    result = {"machine": platform.machine(), "artifact": str(art), "prompt_tokens": len(ids),
              "nodes": first_differing(nodes(art, ids)),
              "logits": logits(art, ids),
              "step_cost": step_cost(art, ids, args.contexts, args.reps)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
