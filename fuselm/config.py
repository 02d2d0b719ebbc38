"""The runtime configuration: every setting fuselm takes from the environment, and the CLI
options that sit beside them, resolved once (when an engine loads, or a conversion starts),
validated, and shown with where each value came from (`fuselm inspect`, `--verbose`).

This is the one module that reads `FUSELM_*` variables (tests/arch checks it); the code that
uses a setting is handed a `RuntimeConfig`. It imports nothing of fuselm but the error root,
so every package may import it without an import cycle. `SETTINGS` is the single list: the
README's configuration table, the error lines and the `--verbose` lines all come from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from fuselm.errors import FuselmError


class ConfigError(FuselmError):
    """A setting with a value fuselm does not take; the message names it and its values."""


@dataclass(frozen=True)
class Setting:
    """One environment variable: the RuntimeConfig field it sets, the values it takes (the
    first is the default unless `default` says otherwise) and what it does."""

    field: str
    env: str
    values: tuple[str, ...]  # () = free text (a folder) or a count, checked by `parse`
    default: str
    what: str

    def parse(self, raw: str) -> object:
        """The field's value for the variable's text; ConfigError names the allowed ones."""
        text = raw.strip()
        if self.field == "kernel_dir":
            return text
        if self.field in ("prefill_dense", "gemv_mma", "mlx_max_ops_per_buffer",
                          "micro_batches"):
            low = self.field in ("mlx_max_ops_per_buffer", "micro_batches")
            if self.field != "mlx_max_ops_per_buffer" and text.lower() == "auto":
                return None
            if not text.isdigit() or (low and int(text) < 1):
                raise ConfigError(f"{self.env}={raw!r}: use {self.allowed()}")
            return int(text)
        if text.lower() not in self.values:
            raise ConfigError(f"{self.env}={raw!r}: use {self.allowed()}")
        return text.lower()

    def allowed(self) -> str:
        if self.field in ("prefill_dense", "gemv_mma"):
            return "auto (default) or a row count N (0: off)"
        if self.field == "mlx_max_ops_per_buffer":
            return f"an operation count N >= 1 (default {self.default})"
        if self.field == "micro_batches":
            return "auto (default) or a count N >= 1 (1: off)"
        return f"one of {', '.join(self.values)} (default {self.default})"


KERNEL_DIR_INLINE = "inline"
EXPORT_ENV = "FUSELM_EXPORT"
CUDA_GRAPH_OPS = 60  # fuselm's MLX_MAX_OPS_PER_BUFFER on MLX-CUDA (BENCHMARKS.md)

SETTINGS: tuple[Setting, ...] = (
    Setting("kernels", "FUSELM_KERNELS", ("auto", "on", "off"), "auto",
            "fuselm's fused CUDA kernels in the decode step: `auto` on MLX's CUDA backend "
            "only, `off` MLX's built-ins everywhere (the reference path), `on` fails where "
            "they cannot run"),
    Setting("fold_norm", "FUSELM_FOLD_NORM", ("epilogue", "0"), "epilogue",
            "CUDA: the residual add + RMSNorm in the epilogue of the Q4 GEMV making the added "
            "row; `0` runs it as a kernel of its own (with FUSELM_ATTN_SPLIT=0: several "
            "engines may decode at once in one process)"),
    Setting("attn_split", "FUSELM_ATTN_SPLIT", ("auto", "0"), "auto",
            "CUDA: decode attention over key splits, as many as fill the GPU (`auto`); `0` "
            "runs one block per query head (with FUSELM_FOLD_NORM=0: several engines may "
            "decode at once in one process)"),
    Setting("prefill_dense", "FUSELM_PREFILL_DENSE", (), "auto",
            "from how many rows a Q4 matmul (a prefill chunk) runs over its weight dequantized "
            "inside the call: `auto` = 256 on MLX-CUDA, never elsewhere; `N` rows; `0` never"),
    Setting("gemv_mma", "FUSELM_GEMV_MMA", (), "auto",
            "CUDA: from how many rows (a batched decode step, float16 / bfloat16) the Q4 GEMV "
            "runs on tensor cores: `auto` = never (the tensor-core form is not yet measured on "
            "a GPU), `N` rows (1: the one-row step too), `0` never"),
    Setting("kv_attn", "FUSELM_KV_ATTN", ("auto", "on", "off"), "auto",
            "CUDA: the decode step's fused attention reads a quantized KV cache (`--kv-bits 8` "
            "or `4`) itself: `auto` = off (its 8- and 4-bit forms compile for sm_90 and match "
            "the MLX path in emulation, but have not yet run on a GPU), `on` runs them, `off` "
            "MLX's ops"),
    Setting("kernel_dir", "FUSELM_KERNEL_DIR", (), "~/.cache/fuselm/cuda",
            "CUDA: the folder of the kernel header files MLX #includes (default "
            "$XDG_CACHE_HOME/fuselm/cuda, else ~/.cache/fuselm/cuda); `inline` hands MLX the "
            "whole kernel text"),
    Setting("mlx_max_ops_per_buffer", "MLX_MAX_OPS_PER_BUFFER", (), str(CUDA_GRAPH_OPS),
            "MLX's own variable: launches per CUDA graph; fuselm sets it to "
            f"{CUDA_GRAPH_OPS} on MLX-CUDA when it is unset (the decode step is host-bound "
            "there)"),
    Setting("micro_batches", "FUSELM_MICRO_BATCHES", (), "auto",
            "`--parallel pipeline`: the batch decoder's rows (the server's) in up to this many "
            "micro-batches a step, so the ranks work on different ones at once: `auto` = one "
            "per pipeline rank; `1` the whole batch through the ranks in turn"),
    Setting("export", EXPORT_ENV, ("auto", "torch"), "auto",
            "convert: `auto` writes the graph with the torch-free builder where it covers "
            "the model, `torch` always traces with torch"),
)
# The CLI options beside them: field -> option, shown with their source by --verbose.
OPTIONS = {"engine": "--engine", "threads": "--threads"}
ENGINES = ("auto", "mlx", "onnxruntime")


@dataclass(frozen=True)
class RuntimeConfig:
    """The resolved settings (see SETTINGS for each). Build one with `resolve`; constructing
    it directly (tests, the Python API) validates the values too. `sources` says where each
    came from: "default", "environment (NAME)" or "option (--flag)"."""

    kernels: str = "auto"
    fold_norm: str = "epilogue"
    attn_split: str = "auto"
    prefill_dense: int | None = None  # None: auto
    gemv_mma: int | None = None  # None: auto
    kv_attn: str = "auto"
    kernel_dir: str = ""  # "": the cache folder; KERNEL_DIR_INLINE; else a folder
    mlx_max_ops_per_buffer: int = CUDA_GRAPH_OPS
    micro_batches: int | None = None  # None: auto (one per pipeline rank)
    export: str = "auto"
    engine: str = "auto"
    threads: int | None = None  # onnxruntime's intra-op threads (None: one per core)
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for s in SETTINGS:
            value = getattr(self, s.field)
            if s.values and value not in s.values:
                raise ConfigError(f"{s.env}={value!r}: use {s.allowed()}")
        if self.prefill_dense is not None and self.prefill_dense < 0:
            raise ConfigError(f"FUSELM_PREFILL_DENSE={self.prefill_dense!r}: use "
                              f"{_SETTING['prefill_dense'].allowed()}")
        if self.gemv_mma is not None and self.gemv_mma < 0:
            raise ConfigError(f"FUSELM_GEMV_MMA={self.gemv_mma!r}: use "
                              f"{_SETTING['gemv_mma'].allowed()}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ConfigError(f"FUSELM_MICRO_BATCHES={self.micro_batches!r}: use "
                              f"{_SETTING['micro_batches'].allowed()}")
        if self.mlx_max_ops_per_buffer < 1:
            raise ConfigError(f"MLX_MAX_OPS_PER_BUFFER={self.mlx_max_ops_per_buffer!r}: use "
                              f"{_SETTING['mlx_max_ops_per_buffer'].allowed()}")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads {self.threads}: use a thread count >= 1")

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "default")

    def with_options(self, **options: object) -> RuntimeConfig:
        """This configuration with the options given (None: not given) in place: the CLI's
        (engine, threads) or, from Python, any field; an option wins over the environment."""
        given = {k: v for k, v in options.items() if v is not None}
        unknown = set(given) - {f.name for f in fields(self)} - {"sources"}
        if unknown or "sources" in given:
            raise TypeError(f"no such option: {', '.join(sorted(unknown or {'sources'}))}")
        srcs = dict(self.sources) | {k: f"option ({OPTIONS.get(k, k)})" for k in given}
        return replace(self, **given, sources=tuple(sorted(srcs.items())))  # type: ignore[arg-type]

    def kernel_folder(self) -> Path | None:
        """The folder for the CUDA kernel headers, or None for inline text."""
        if self.kernel_dir.lower() == KERNEL_DIR_INLINE:
            return None
        if self.kernel_dir:
            return Path(self.kernel_dir).expanduser()
        return cache_folder() / "cuda"

    def rows(self) -> list[tuple[str, str, str]]:
        """(name, value, source) for every setting and option, for inspect and --verbose."""
        out = []
        for s in SETTINGS:
            value = getattr(self, s.field)
            if s.field == "kernel_dir":
                value = self.kernel_folder() or KERNEL_DIR_INLINE
            out.append((s.env, "auto" if value is None else str(value), self.source(s.field)))
        for name, flag in OPTIONS.items():
            value = getattr(self, name)
            out.append((flag, "auto" if value is None else str(value), self.source(name)))
        return out

    def lines(self) -> list[str]:
        rows = self.rows()
        width = max(len(n) for n, _, _ in rows)
        vwidth = max(len(v) for _, v, _ in rows)
        return [f"{n:<{width}}  {v:<{vwidth}}  {src}" for n, v, src in rows]


def cache_folder() -> Path:
    """fuselm's cache: $XDG_CACHE_HOME/fuselm, else ~/.cache/fuselm (the CUDA kernel headers,
    the models `run`, `serve`, `fuselm.load` ... converted from a GGUF or an HF folder)."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "fuselm"


_SETTING = {s.field: s for s in SETTINGS}
assert {f.name for f in fields(RuntimeConfig)} == set(_SETTING) | set(OPTIONS) | {"sources"}


def resolve(environ: Mapping[str, str] | None = None, **options: object) -> RuntimeConfig:
    """The configuration from the environment (default: this process's) and the options given
    (None: not given; RuntimeConfig.with_options); an option wins over the environment, which
    wins over the default. An empty variable counts as unset. ConfigError on a bad value."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        raw = env.get(s.env, "")
        if raw.strip():
            values[s.field] = s.parse(raw)
            sources[s.field] = f"environment ({s.env})"
    base = RuntimeConfig(**values, sources=tuple(sorted(sources.items())))  # type: ignore[arg-type]
    return base.with_options(**options)


def apply_mlx_settings(config: RuntimeConfig) -> None:
    """Hand MLX its launches per CUDA graph (MLX reads MLX_MAX_OPS_PER_BUFFER once, at the
    first GPU evaluation of the process). The caller calls this on MLX's CUDA backend only:
    Metal reads the same variable for its command buffers, and keeps its own default."""
    os.environ[_SETTING["mlx_max_ops_per_buffer"].env] = str(config.mlx_max_ops_per_buffer)


def markdown_table() -> str:
    """The README's configuration table (tests/ux checks that the README holds it)."""
    rows = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    for s in SETTINGS:
        values = (", ".join(f"`{v}`" for v in s.values) if s.values
                  else "a folder, `inline`" if s.field == "kernel_dir"
                  else "`auto`, a row count" if s.field in ("prefill_dense", "gemv_mma")
                  else "`auto`, a count" if s.field == "micro_batches"
                  else "an operation count")
        rows.append(f"| `{s.env}` | {values} | `{s.default}` | {s.what} |")
    return "\n".join(rows) + "\n"
