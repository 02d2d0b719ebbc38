"""A model's size from its manifest: parameter count, and what that means for MLX on a CPU."""

from __future__ import annotations

from fuselm.runtime_metal.artifact import ModelInfo

# Above this, MLX's single-threaded CPU backend is painfully slow (seconds per token).
MLX_CPU_PARAMS = 50_000_000
# Decode does about 2 FLOPs per parameter per token; MLX's CPU backend reached 0.75 GFLOP/s
# on them: SmolLM2-135M Q4 decoded at 2.8 tokens/s on a 2-core x86 host, as fast as mlx-lm's
# own decode there (BENCHMARKS.md, "MLX on a CPU"; onnxruntime: 141 tokens/s).
MLX_CPU_FLOPS = 0.75e9


def decoder_parameters(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                       intermediate: int, vocab: int, tied: bool, *, qkv_bias: bool = False,
                       o_bias: bool = False, mlp_bias: bool = False, qk_norm: bool = False,
                       sandwich_norms: bool = False) -> int:
    """Every parameter of the decoder, as transformers' num_parameters() counts them (a tied
    table once): embeddings, attention, MLP, their biases, every norm, an untied LM head."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden
    attn += (q + 2 * kv if qkv_bias else 0) + (hidden if o_bias else 0)
    attn += 2 * head_dim if qk_norm else 0
    mlp = 3 * hidden * intermediate + (2 * intermediate + hidden if mlp_bias else 0)
    norms = (4 if sandwich_norms else 2) * hidden
    embed = vocab * hidden * (1 if tied else 2)
    return embed + layers * (attn + mlp + norms) + hidden


def parameter_count(m: ModelInfo) -> int:
    """The model's parameter count: the one its conversion recorded (every bias and norm its
    family has), else (an artifact from before the record) the plain decoder's."""
    if m.parameters is not None:
        return m.parameters
    return decoder_parameters(m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads,
                              m.head_dim, m.intermediate_size, m.vocab_size,
                              m.tie_word_embeddings)


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
