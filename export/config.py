"""config.json → DecoderSpec: every number the exporter needs, validated once, with clear errors.

transformers' own config classes supply the defaults (head_dim, rope_parameters from 4.x
`rope_theta`/`rope_scaling` or 5.x `rope_parameters`), and its RoPE init functions compute the
frequencies, so the exported model uses exactly the frequencies HF does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fuselm.export.config_check import check_config
from fuselm.export.errors import ExportError
from fuselm.input_files import check_regular, load_file
from fuselm.runtime_metal.model_size import decoder_parameters

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass
class RopeSpec:
    type: str
    theta: float
    rotary_dim: int
    inv_freq: np.ndarray  # float32 [rotary_dim / 2]
    attention_scale: float = 1.0
    dynamic_factor: float = 0.0  # > 0: dynamic NTK, inv_freq recomputed from the positions
    dynamic_max_positions: int = 0
    # LongRoPE: long_inv_freq replaces inv_freq when max(position_ids) + 1 > long_after
    long_inv_freq: np.ndarray | None = None
    long_after: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class DecoderSpec:
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    context_length: int
    rope: RopeSpec
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # per layer: None = full attention, W = attend to the last W positions only
    windows: list[int | None] = field(default_factory=list)
    # per layer: its RoPE, or None for a layer without position encoding (NoPE)
    ropes: list[RopeSpec | None] = field(default_factory=list)
    activation: str = "silu"  # the MLP gate's: "silu" or "gelu_tanh" (FusedGateUp)
    sandwich_norms: bool = False  # RMSNorm on each sublayer's output before its residual add
    embed_scale: float = 1.0  # embeddings multiplied by this
    residual_scale: float = 1.0  # each sublayer's output multiplied by this before the add
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # > 0: scores = softcap * tanh(scores / softcap)
    logit_scale: float = 1.0  # logits multiplied by this
    logit_softcap: float = 0.0  # > 0: logits = softcap * tanh(logits / softcap)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    @property
    def sliding_window(self) -> int | None:
        return next((w for w in self.windows if w is not None), None)

    @property
    def parameters(self) -> int:
        """Every parameter of this decoder (fuselm.json's model.parameters)."""
        return decoder_parameters(
            self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim,
            self.intermediate_size, self.vocab_size, self.tie_word_embeddings,
            qkv_bias=self.qkv_bias, o_bias=self.o_bias, mlp_bias=self.mlp_bias,
            qk_norm=self.qk_norm, sandwich_norms=self.sandwich_norms)


def read_raw_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ExportError(f"{model_dir} is not a directory; pass an HF model directory")
    check_regular(path)
    if not path.is_file():
        raise ExportError(f"{path} not found; pass an HF model directory (config.json + weights)")
    try:
        raw = load_file(path)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and JSONTooDeep too
        raise ExportError(f"{path} is not valid JSON ({e})") from None
    except PermissionError as e:
        raise ExportError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    check_config(raw, path, ROPE_TYPES)  # types, ranges, ids: before transformers sees them
    return raw


def load_hf_config(model_dir: Path):  # noqa: ANN201 - a transformers PretrainedConfig
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ExportError(f"transformers cannot read {model_dir}/config.json: {e}") from e


def default_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """theta ** (-2i / rotary_dim) for i < rotary_dim / 2, float32 (HF's default RoPE: the
    exponents and the reciprocal in float32, as transformers computes them; the power rounded
    once from float64, where torch's may differ from it in the last bit)."""
    exps = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    power = (np.float64(np.float32(theta)) ** exps.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / power


def rope_spec(hf_config: Any, head_dim: int, layer_type: str | None = None) -> RopeSpec:
    """The RoPE of `hf_config` (of its `layer_type` layers where RoPE differs per layer type),
    with frequencies from transformers' own init functions (the default ones in NumPy, so
    that a config without RoPE scaling needs neither torch nor transformers' model code:
    `hf_config` may then be any object with the config's attributes)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type] or {})
    if not params:  # transformers 4.x attributes
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ExportError(
            f"RoPE type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = float(params.get("rope_theta", 10000.0))
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if rope_type == "default":
        inv_freq, scale = default_inv_freq(theta, rotary_dim), 1.0
    else:
        import torch
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        with torch.device("cpu"):
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](
                hf_config, "cpu", layer_type=layer_type
            )
    spec = RopeSpec(
        type=rope_type,
        theta=theta,
        rotary_dim=rotary_dim,
        inv_freq=np.asarray(inv_freq, dtype=np.float32),
        attention_scale=float(scale),
        parameters={k: v for k, v in params.items() if isinstance(v, (int, float, str))},
    )
    if rope_type == "longrope":
        after = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        if not after:
            raise ExportError("longrope RoPE needs original_max_position_embeddings in config.json")
        with torch.device("cpu"):
            long, _ = ROPE_INIT_FUNCTIONS[rope_type](
                hf_config, "cpu", seq_len=int(after) + 1, layer_type=layer_type
            )
        spec.long_inv_freq = np.asarray(long, dtype=np.float32)
        spec.long_after = int(after)
    if rope_type == "dynamic":
        spec.dynamic_factor = float(params["factor"])
        spec.dynamic_max_positions = int(hf_config.max_position_embeddings)
    return spec
