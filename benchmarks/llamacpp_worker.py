"""llama.cpp's side of benchmarks/llamacpp_compare.py, run by the Python of a venv that holds
llama-cpp-python (built from its source release, outside this repository). It imports nothing of
fuselm: it reads one JSON request on stdin and prints one JSON object.

    {"op": "quantize", "src": F16.gguf, "dst": OUT.gguf, "type": "Q4_K_M"}
    {"op": "logits", "gguf": PATH, "chunks": [[ids...], ...], "out": DIR}
        -> every position's logits of each chunk, from an empty cache, as DIR/chunk_I.npy
    {"op": "speed", "gguf": PATH, "prompt": [ids...], "new_tokens": 128, "repetitions": 3}
        -> prefill and greedy decode tokens/s (medians after one warm-up), llama.cpp's default
           threads
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

FTYPES = {  # llama.h's llama_ftype values
    "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K_M": 12, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
    "IQ4_NL": 25, "IQ3_S": 26, "IQ4_XS": 30, "TQ1_0": 36, "TQ2_0": 37,
}


def quantize(src: str, dst: str, kind: str) -> dict:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {kind} failed: {rc}")
    return {"dst": dst, "bytes": Path(dst).stat().st_size}


def logits(gguf: str, chunks: list[list[int]], out: str) -> dict:
    n = max(len(c) for c in chunks)
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True,
                          verbose=False)
    files = []
    for i, ids in enumerate(chunks):
        llm.reset()
        llm.eval(ids)
        path = Path(out) / f"chunk_{i}.npy"
        np.save(path, np.asarray(llm.scores[:len(ids)], dtype=np.float32))
        files.append(str(path))
    return {"files": files, "n_threads": llm.n_threads if hasattr(llm, "n_threads") else None}


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    """The logits of the last evaluated position (kept by llama.cpp's context: without
    logits_all, llama-cpp-python stores no scores of its own)."""
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def speed(gguf: str, prompt: list[int], new_tokens: int, repetitions: int) -> dict:
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt) + new_tokens + 8, verbose=False)
    pp, tg = [], []
    for rep in range(repetitions + 1):  # the first run warms up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = int(np.argmax(last_logits(llm)))
        t2 = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([tok])
            tok = int(np.argmax(last_logits(llm)))
        t3 = time.perf_counter()
        if rep:
            pp.append(len(prompt) / (t1 - t0))
            tg.append(new_tokens / (t3 - t2))
    return {"pp_tok_s": statistics.median(pp), "tg_tok_s": statistics.median(tg),
            "pp_runs": pp, "tg_runs": tg, "n_threads": llm.context_params.n_threads,
            "llama_cpp_python": llama_cpp.__version__}


def main() -> None:
    req = json.load(sys.stdin)
    op = req.pop("op")
    if op == "quantize":
        res = quantize(req["src"], req["dst"], req["type"])
    elif op == "logits":
        res = logits(req["gguf"], req["chunks"], req["out"])
    elif op == "speed":
        res = speed(req["gguf"], req["prompt"], req["new_tokens"], req["repetitions"])
    else:
        raise SystemExit(f"unknown op {op}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
