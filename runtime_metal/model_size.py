"""A model's size from its manifest: parameter count, and what that means for MLX on a CPU."""

from __future__ import annotations

from fuselm.runtime_metal.artifact import ModelInfo

# Above this, MLX's single-threaded CPU backend is painfully slow (seconds per token).
MLX_CPU_PARAMS = 50_000_000
# Decode does about 2 FLOPs per parameter per token; MLX's CPU backend reached 0.75 GFLOP/s
# on them: SmolLM2-135M Q4 decoded at 2.8 tokens/s on a 2-core x86 host, as fast as mlx-lm's
# own decode there (BENCHMARKS.md, "MLX on a CPU"; onnxruntime: 141 tokens/s).
MLX_CPU_FLOPS = 0.75e9


def parameter_count(m: ModelInfo) -> int:
    """Weights of the decoder: embeddings, attention, MLP, norms (and an untied LM head)."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attn = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    mlp = 3 * m.hidden_size * m.intermediate_size
    per_layer = attn + mlp + 2 * m.hidden_size
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return embed + m.num_layers * per_layer + m.hidden_size


def human(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


def mlx_cpu_warning(m: ModelInfo) -> str | None:
    """The warning for `--engine mlx` on a host where MLX has no GPU, or None."""
    params = parameter_count(m)
    if params <= MLX_CPU_PARAMS:
        return None
    speed = MLX_CPU_FLOPS / (2 * params)
    return (f"warning: MLX has no GPU on this host and its CPU backend runs on one core; for "
            f"this {human(params)}-parameter model expect roughly {speed:.1f} tokens/s "
            "(scaled from 2.8 tokens/s measured on a 135M model, mlx-lm's own speed there). "
            "--engine onnxruntime (the default here) uses every core and is ~50x faster")
