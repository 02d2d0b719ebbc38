"""The clean decoder module every family exports through.

HF's modules carry dispatch, caching classes and mask utilities that trace into thousands of
nodes; this one computes the same function with exactly the ops the graph contract wants:
Gather, RMSNormalization, MatMul(x, W[K, N]) (+Add bias), fuselm.FusedRoPE, ONNX Attention with
the KV concat inside, a gated MLP (SiLU or tanh-GELU). Weights are parameters laid out [K, N] so
that MatMul consumes them directly; the module is built on the meta device for export (MNN's
FakeLinear idea: no weights in the trace) and `weight_sources()` asks the model's family
(export/family.py) where each parameter comes from. Every variant here is a DecoderSpec field
(sandwich norms, scales, soft-capping, per-layer RoPE or none); no family is named.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.export import torch_ops  # noqa: F401 - registers torch.ops.fuselm.*
from fuselm.export.config import DecoderSpec, RopeSpec
from fuselm.export.family import Source
from fuselm.export.registry import family_of

__all__ = ["Decoder", "Source", "attention_mask_4d"]


class Linear(nn.Module):
    def __init__(self, k: int, n: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(k, n, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y


def _norm_weight(n: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False)


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x if scale == 1.0 else x * scale


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return x if cap <= 0 else torch.tanh(x / cap) * cap


class Layer(nn.Module):
    def __init__(self, spec: DecoderSpec, rope: RopeSpec | None, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.spec = spec
        self.rope = rope
        self.input_norm = _norm_weight(h, dtype)
        self.q_proj = Linear(h, spec.num_heads * d, spec.qkv_bias, dtype)
        self.k_proj = Linear(h, spec.num_kv_heads * d, spec.qkv_bias, dtype)
        self.v_proj = Linear(h, spec.num_kv_heads * d, spec.qkv_bias, dtype)
        self.o_proj = Linear(spec.num_heads * d, h, spec.o_bias, dtype)
        if spec.qk_norm:
            self.q_norm = _norm_weight(d, dtype)
            self.k_norm = _norm_weight(d, dtype)
        self.post_norm = _norm_weight(h, dtype)
        if spec.sandwich_norms:
            self.attn_out_norm = _norm_weight(h, dtype)
            self.mlp_out_norm = _norm_weight(h, dtype)
        self.gate_proj = Linear(h, spec.intermediate_size, spec.mlp_bias, dtype)
        self.up_proj = Linear(h, spec.intermediate_size, spec.mlp_bias, dtype)
        self.down_proj = Linear(spec.intermediate_size, h, spec.mlp_bias, dtype)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        eps = s.rms_norm_eps
        h = F.rms_norm(x, (s.hidden_size,), self.input_norm, eps)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        r = self.rope
        if r is not None:  # a layer without RoPE (NoPE) hands q and k straight to attention
            q, k = torch.ops.fuselm.rope(
                q,
                k,
                position_ids,
                self.q_norm if s.qk_norm else None,
                self.k_norm if s.qk_norm else None,
                s.head_dim,
                r.rotary_dim,
                [float(f) for f in r.inv_freq],
                r.attention_scale,
                0,
                eps,
                r.dynamic_factor,
                r.dynamic_max_positions,
                r.theta,
                [] if r.long_inv_freq is None else [float(f) for f in r.long_inv_freq],
                r.long_after,
            )
        scale = s.attention_scale if s.attention_scale is not None else s.head_dim**-0.5
        y, present_key, present_value = torch.ops.fuselm.attention(
            q, k, v, mask, past_key, past_value, s.num_heads, s.num_kv_heads, scale,
            s.attn_softcap,
        )
        y = self.o_proj(y)
        if s.sandwich_norms:
            y = F.rms_norm(y, (s.hidden_size,), self.attn_out_norm, eps)
        x = x + _scaled(y, s.residual_scale)
        h = F.rms_norm(x, (s.hidden_size,), self.post_norm, eps)
        gate = self.gate_proj(h)
        act = F.silu(gate) if s.activation == "silu" else F.gelu(gate, approximate="tanh")
        y = self.down_proj(act * self.up_proj(h))
        if s.sandwich_norms:
            y = F.rms_norm(y, (s.hidden_size,), self.mlp_out_norm, eps)
        x = x + _scaled(y, s.residual_scale)
        return x, present_key, present_value


def attention_mask_4d(attention_mask: torch.Tensor, seq: int, window: int | None) -> torch.Tensor:
    """bool [batch, 1, seq, total]: causal (query i sits at absolute position total - seq + i),
    padding from `attention_mask`, an optional sliding window, and each query sees itself
    (so a fully padded row never turns into NaN that 0-weights would still propagate)."""
    total = attention_mask.shape[1]
    device = attention_mask.device
    k_pos = torch.arange(total, device=device)[None, :]
    q_pos = (torch.arange(seq, device=device) + (total - seq))[:, None]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    padded = attention_mask.bool()[:, None, None, :]
    return (allowed[None, None] & padded) | (k_pos == q_pos)[None, None]


class Decoder(nn.Module):
    def __init__(self, spec: DecoderSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Parameter(
            torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype), requires_grad=False
        )
        ropes = spec.ropes or [spec.rope] * spec.num_layers
        self.layers = nn.ModuleList(Layer(spec, ropes[i], dtype) for i in range(spec.num_layers))
        self.norm = _norm_weight(spec.hidden_size, dtype)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(spec.hidden_size, spec.vocab_size, dtype=dtype), requires_grad=False
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        seq = input_ids.shape[1]
        # one mask per distinct window, in first-layer order (a set's order would vary from
        # one process to the next, and with it the graph's node order)
        masks = {w: attention_mask_4d(attention_mask, seq, w)
                 for w in dict.fromkeys(self.spec.windows)}
        x = _scaled(F.embedding(input_ids, self.embed), self.spec.embed_scale)
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            mask = masks[self.spec.windows[i]]
            x, pk, pv = layer(x, position_ids, mask, past[2 * i], past[2 * i + 1])
            presents += [pk, pv]
        x = F.rms_norm(x, (self.spec.hidden_size,), self.norm, self.spec.rms_norm_eps)
        head = self.embed.t() if self.spec.tie_word_embeddings else self.lm_head
        logits = _softcap(_scaled(x @ head, self.spec.logit_scale), self.spec.logit_softcap)
        return (logits, *presents)

    def weight_sources(self) -> dict[str, Source]:
        """Parameter name → where its values live in the HF checkpoint (the family says)."""
        names = [name for name, _ in self.named_parameters()]
        return family_of(self.spec.architecture).sources(self.spec, names)
