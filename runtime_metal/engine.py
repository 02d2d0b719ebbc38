"""The engine interface the generation loop drives, and `make_engine` (auto: MLX on a GPU,
onnxruntime on CPU-only hosts, where MLX's CPU backend is single-threaded and slow)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fuselm.config import RuntimeConfig, resolve
from fuselm.runtime_metal.errors import RuntimeUserError

if TYPE_CHECKING:
    from fuselm.runtime_metal.kv_cache import KVQuant
    from fuselm.runtime_metal.manifest_types import Manifest

ENGINES = ("auto", "mlx", "onnxruntime")


class Engine(Protocol):
    """What the generation loop (generate.py) and the batch decoder (batch.py) drive. Every
    engine implements all of it; `device_loop` says whether decode_step's logits stay on a
    device (MLX: the loop samples there and pipelines) or are host arrays (onnxruntime)."""

    name: str
    device_loop: bool
    manifest: Manifest
    kv_quant: KVQuant | None  # how the KV cache is stored (None: float; batch.py's blocks too)

    @property
    def offset(self) -> int:
        """Positions already in the KV cache."""
        ...

    def reset(self) -> None: ...

    def reserve(self, n: int) -> None:
        """Room for n cached positions, before a generation (engines may have nothing to do)."""
        ...

    def trim(self, n: int) -> None:
        """Forget the last n cached positions."""
        ...

    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Feed ids [1, s] after the cached positions; return float32 logits of the last
        position [vocab] (or of all positions [s, vocab])."""
        ...

    def forward_device(self, ids: np.ndarray, all_logits: bool = False) -> Any:
        """`forward` without the copy to the host: lazy device logits where the engine has a
        device (MLX), the host array otherwise."""
        ...

    def verify(self, ids: np.ndarray) -> np.ndarray:
        """Feed ids [1, s] after the cached positions in one step; return the host float32
        logits of every position [s, vocab]: speculative decoding's check of drafted tokens
        (the caller trims the positions it rejects)."""
        ...

    def decode_step(self, token: Any) -> Any:
        """Feed one token (an int, or a device scalar that may still be lazy); return its
        logits [vocab] (device array for a device_loop engine, else host float32)."""
        ...

    def swap_cache(self, state: Any = None) -> Any:
        """Install a cache state returned by an earlier swap (None: a fresh, empty cache) and
        return the one in use: how batch.py serves several sequences on one engine."""
        ...

    def batch_program(self) -> tuple[Any, list[Any], int] | None:
        """(function, KV layout, span step) that decodes one token for each of b sequences at
        once over the block cache (decode.DecodeProgram.paged: fn(tokens [b, 1], offsets [b],
        block table [b, W], *pools) -> (logits [b, vocab], offsets + 1, *pools)), or None
        where the engine has none. Span step: the multiple of positions that the table's width
        is rounded up to (0: every row's most blocks, where the attention kernel reads each
        row's own length anyway)."""
        ...

    def describe(self) -> dict[str, object]: ...


def mlx_has_gpu() -> bool:
    import mlx.core as mx

    try:
        return bool(mx.metal.is_available()) or bool(getattr(mx, "cuda", None)
                                                      and mx.cuda.is_available())
    except Exception:  # an MLX build without a GPU backend module
        return False


def resolve_engine(name: str, parallel: str | None = None) -> str:
    """The engine `name` means here; `parallel` (a model over several ranks) runs on MLX."""
    if name not in ENGINES:
        raise RuntimeUserError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    if parallel:
        if name == "onnxruntime":
            raise RuntimeUserError(f"--parallel {parallel} runs on the MLX engine (its "
                                   "mx.distributed layer); drop --engine onnxruntime")
        return "mlx"
    if name == "auto":
        return "mlx" if mlx_has_gpu() else "onnxruntime"
    return name


KV_OPTIONS = ("kv_bits", "kv_group_size")  # the MLX engine's quantized KV cache


def check_kv_options(engine: str, options: dict[str, object]) -> None:
    """A quantized KV cache is the MLX engine's; for onnxruntime it is refused by name."""
    given = [k for k in KV_OPTIONS if options.get(k) is not None]
    if engine == "onnxruntime" and given:
        raise RuntimeUserError(
            f"--{given[0].replace('_', '-')}: the onnxruntime engine keeps its KV cache in float "
            "(its attention ops read no quantized K/V); use --engine mlx for a quantized KV "
            "cache")


def check_engine_options(engine: str, cls: type, options: dict[str, object]) -> None:
    """An option the chosen engine's constructor does not take is refused by name (the API's
    load(engine="mlx", accuracy_level=0), say), never handed on to fail as a TypeError."""
    import inspect

    taken = set(inspect.signature(cls.__init__).parameters) - {"self", "out_dir", "manifest"}
    other = [k for k in options if k not in taken]
    if other:
        raise RuntimeUserError(
            f"{other[0]}: not an option of the {engine} engine (it takes "
            f"{', '.join(sorted(taken - {'config'}))}); drop it or choose the engine it belongs to")


def make_engine(out_dir: str | Path, name: str = "auto", config: RuntimeConfig | None = None,
                **options: object) -> Engine:
    """Open an artifact with engine `name`; options go to that engine (e.g. accuracy_level).
    config: the runtime settings (fuselm/config.py), resolved from the environment here when
    not given: once per engine; its --threads go to onnxruntime unless options name them."""
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.integrity import check_graph, check_sizes

    config = config if config is not None else resolve()
    manifest = read_manifest(out_dir)
    check_sizes(out_dir, manifest)
    check_graph(out_dir, manifest)
    resolved = resolve_engine(name, options.get("parallel"))  # type: ignore[arg-type]
    if resolved == "mlx":
        from fuselm.runtime_metal.mlx_engine.engine import MLXEngine

        check_engine_options(resolved, MLXEngine, options)
        return MLXEngine(out_dir, manifest, config=config, **options)  # type: ignore[arg-type]
    from fuselm.runtime_metal.ort_engine.engine import OrtEngine

    check_kv_options(resolved, options)
    check_engine_options(resolved, OrtEngine, options)
    if config.threads is not None:
        options.setdefault("threads", config.threads)
    return OrtEngine(out_dir, manifest, **options)  # type: ignore[arg-type]
