"""A KV cache budget in tokens: `--max-kv-tokens N` as given, or `--memory-limit GB` turned into
tokens by the bytes one cached token takes in this artifact on this engine."""

from __future__ import annotations

from fuselm.runtime_metal.artifact import Manifest
from fuselm.runtime_metal.errors import RuntimeUserError

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GB = 10**9  # --memory-limit counts decimal gigabytes


def kv_token_bytes(manifest: Manifest, engine: str, kv_bits: int | None = None,
                   kv_group_size: int | None = None) -> int:
    """Bytes one cached position takes, every layer's key and value: onnxruntime's lowered
    graph keeps its KV buffers in float32 whatever the artifact's dtype (ort_engine/
    shared_kv.py; its plain graph no more), MLX in the graph's own dtype, float16 computed in
    float32 on a CPU (dtypes.half); with kv_bits (MLX), the quantized values plus a scale and
    a bias of that dtype per group (kv_cache.KVQuant)."""
    m = manifest.model
    if engine == "onnxruntime":
        size = 4
    elif manifest.dtype in ("float16", "bfloat16"):
        import mlx.core as mx

        from fuselm.runtime_metal.dtypes import half

        size = half(mx.bfloat16 if manifest.dtype == "bfloat16" else mx.float16).size
    else:
        size = ELEMENT_BYTES[manifest.dtype]
    values = 2 * m.num_layers * m.num_kv_heads * m.head_dim
    if kv_bits is None or engine == "onnxruntime":
        return values * size
    group = kv_group_size or 64
    return int(values * (kv_bits / 8 + 2 * size / group))


def budget_tokens(max_kv_tokens: int | None, memory_limit_gb: float | None,
                  token_bytes: int) -> int | None:
    """The KV budget in tokens from either flag (None: neither given, no budget)."""
    if max_kv_tokens is not None and memory_limit_gb is not None:
        raise RuntimeUserError("give --max-kv-tokens or --memory-limit, not both")
    if memory_limit_gb is None:
        return max_kv_tokens
    tokens = int(memory_limit_gb * GB // token_bytes)
    if tokens < 1:
        raise RuntimeUserError(
            f"--memory-limit {memory_limit_gb:g} GB holds no KV cache token of this model "
            f"({token_bytes} bytes each)")
    return tokens


def describe_budget(tokens: int, token_bytes: int) -> str:
    """'4096 tokens (150.99 MB of KV cache at 36864 bytes/token)'."""
    return (f"{tokens} tokens ({tokens * token_bytes / 1e6:.2f} MB of KV cache at "
            f"{token_bytes} bytes/token)")
