"""Perplexity of a text, scored the way llama.cpp's `llama-perplexity` does.

The rule (one definition, used for every system we compare — fuselm's engines, HF
transformers, mlx-lm):

- the text is tokenized once, without special tokens (no BOS is added);
- the tokens are cut into consecutive, non-overlapping chunks of `context` tokens; a last
  partial chunk is dropped;
- each chunk is evaluated on its own, from an empty KV cache;
- only the second half of each chunk is scored: the tokens at positions context/2 + 1 ..
  context-1 (context/2 - 1 of them: llama-perplexity's `first = n_ctx/2` and its
  `n_ctx - 1 - first` tokens, so the same logits give its number), each predicted from every
  token before it in the chunk, so every scored token sees more than context/2 tokens;
- PPL = exp(mean NLL) over all scored tokens; its ± is the standard error of the mean NLL
  carried through exp (delta method: PPL · SE), as llama-perplexity prints it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fuselm.input_files import check_regular
from fuselm.runtime_metal.errors import RuntimeUserError

# A fixed English prose text shipped with the package, for tests, validate and benchmarks.
SAMPLE_TEXT = Path(__file__).parent / "english_prose.txt"

OnChunk = Callable[[int, int, float], None]  # (chunks done, chunks, PPL so far)
Logits = Callable[[list[int]], np.ndarray]  # chunk ids -> float logits [len(ids), vocab]


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float  # ± on PPL (delta method)
    nll: float  # mean negative log-likelihood (nats per token)
    context: int
    chunks: int
    scored_tokens: int
    evaluated_tokens: int
    seconds: float  # time in the model's forward passes
    tokens_per_s: float  # evaluated tokens / seconds
    engine: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_MAX_LOG = math.log(sys.float_info.max)


def read_text(path: str | Path) -> str:
    p = Path(path)
    check_regular(p)
    if not p.is_file():
        raise RuntimeUserError(f"--text {p} does not exist; pass a UTF-8 text file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RuntimeUserError(f"--text {p} is not UTF-8 text ({e})") from e


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    """The text's tokens, no special tokens added (the rule above)."""
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def chunks(tokens: Sequence[int], context: int) -> list[list[int]]:
    if context < 4 or context % 2:
        raise RuntimeUserError(f"--context must be an even number >= 4, got {context}")
    n = len(tokens) // context
    if n == 0:
        raise RuntimeUserError(
            f"the text has {len(tokens)} tokens, fewer than one chunk of --context {context}; "
            "pass a longer text or a smaller --context")
    return [list(tokens[i * context:(i + 1) * context]) for i in range(n)]


def chunk_nll(logits: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """NLL of the second half of one chunk: tokens ids[c/2 + 1:], from the logits at positions
    c/2 .. c-2 (llama-perplexity's count, the module's rule)."""
    c = len(ids)
    first = c // 2
    if logits.shape[0] != c:
        raise ValueError(f"logits for {logits.shape[0]} positions, chunk has {c}")
    z = np.asarray(logits[first:c - 1], dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1))
    targets = np.asarray(ids[first + 1:], dtype=np.int64)
    return log_norm - z[np.arange(len(targets)), targets]


def perplexity_of(logits_fn: Logits, tokens: Sequence[int], context: int = 512,
                  engine: str = "", on_chunk: OnChunk | None = None) -> PerplexityResult:
    """PPL of `tokens` under `logits_fn` (any system), with the chunking rule above;
    `on_chunk(done, total, ppl so far)` after each chunk (progress, as llama-perplexity's)."""
    nlls: list[np.ndarray] = []
    seconds = 0.0
    parts = chunks(tokens, context)
    for ids in parts:
        t0 = time.perf_counter()
        logits = logits_fn(ids)
        seconds += time.perf_counter() - t0
        nlls.append(chunk_nll(np.asarray(logits), ids))
        if on_chunk is not None:
            so_far = float(np.concatenate(nlls).mean())
            on_chunk(len(nlls), len(parts), math.exp(so_far) if so_far < _MAX_LOG else math.inf)
    nll = np.concatenate(nlls)
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    # A mean NLL past ~709 (a broken graph's logits) overflows exp: the perplexity is then
    # infinite, a result the verdict reads, not an OverflowError.
    ppl = math.exp(mean) if mean < _MAX_LOG else math.inf
    evaluated = len(parts) * context
    return PerplexityResult(
        ppl=ppl, ppl_stderr=ppl * se, nll=mean, context=context, chunks=len(parts),
        scored_tokens=len(nll), evaluated_tokens=evaluated, seconds=seconds,
        tokens_per_s=evaluated / seconds if seconds > 0 else float("inf"), engine=engine)


def engine_logits_fn(engine: Any) -> Logits:
    """A fuselm engine as a logits function: one fresh-cache forward per chunk."""

    def run(ids: list[int]) -> np.ndarray:
        engine.reset()
        return engine.forward(np.asarray(ids, dtype=np.int64)[None], all_logits=True)

    return run


def perplexity(out_dir: str | Path, text: str, context: int = 512, engine: str = "auto",
               on_chunk: OnChunk | None = None, **engine_options: Any) -> PerplexityResult:
    """PPL of `text` under the artifact in `out_dir`, through engine `engine`; `on_chunk`:
    perplexity_of's."""
    from fuselm.runtime_metal.loaded_model import open_model

    model = open_model(out_dir, engine, defer_engine=True, **engine_options)
    if context > model.manifest.model.context_length:
        raise RuntimeUserError(
            f"--context {context} exceeds the model's context length "
            f"{model.manifest.model.context_length}")
    tokens = text_tokens(model.tokenizer, text)
    eng = model.engine
    return perplexity_of(engine_logits_fn(eng), tokens, context, engine=eng.name,
                         on_chunk=on_chunk)
