"""Torch custom ops that export as single ONNX nodes: fuselm.FusedRoPE and ONNX `Attention`.

Each op has an eager implementation (real math, so the clean decoder also runs in torch), a fake
implementation (shapes only: export traces on the meta device, without weights), and a
translation used by `torch.onnx.export(custom_translation_table=TRANSLATIONS)`.
"""

from __future__ import annotations

import onnxscript
import torch

from fuselm.passes import ops

ops.register_schemas()
_fuselm = onnxscript.values.Opset(ops.DOMAIN, ops.DOMAIN_VERSION)
_onnx = onnxscript.values.Opset("", ops.ONNX_OPSET)


def _rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float, interleaved: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # [batch, seq, 1, rotary_dim]: broadcasts over the heads axis of [batch, seq, heads, dim].
    freqs = position_ids.float()[..., None] * inv_freq
    if interleaved:
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
    else:
        emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale)[:, :, None, :], (emb.sin() * scale)[:, :, None, :]


def _dynamic_inv_freq(
    position_ids: torch.Tensor, theta: float, rotary_dim: int, factor: float, max_pos: int
) -> torch.Tensor:
    length = torch.clamp(position_ids.max().float() + 1, min=float(max_pos))
    base = theta * ((factor * length / max_pos) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exps)


@torch.library.custom_op("fuselm::rope", mutates_args=())
def fused_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    head_dim: int,
    rotary_dim: int,
    inv_freq: list[float],
    attention_scale: float,
    interleaved: int,
    norm_eps: float,
    dynamic_factor: float,
    dynamic_max_positions: int,
    rope_theta: float,
    long_inv_freq: list[float],
    long_after: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if long_after > 0 and int(position_ids.max()) + 1 > long_after:
        freq = torch.tensor(long_inv_freq, dtype=torch.float32)
    elif dynamic_factor > 0:
        freq = _dynamic_inv_freq(
            position_ids, rope_theta, rotary_dim, dynamic_factor, dynamic_max_positions
        )
    else:
        freq = torch.tensor(inv_freq, dtype=torch.float32)
    cos, sin = _rope_cos_sin(position_ids, freq, attention_scale, interleaved)

    def one(x: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        h = x.reshape(b, s, -1, head_dim)
        if norm is not None:
            h32 = h.float()
            h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + norm_eps)
            h = (h32 * norm.float()).to(x.dtype)
        h = h.float()
        r = h[..., :rotary_dim]
        if interleaved:
            rot = torch.stack([-r[..., 1::2], r[..., 0::2]], dim=-1).reshape(r.shape)
        else:
            rot = torch.cat([-r[..., rotary_dim // 2 :], r[..., : rotary_dim // 2]], dim=-1)
        out = torch.cat([r * cos + rot * sin, h[..., rotary_dim:]], dim=-1)
        return out.to(x.dtype).reshape(b, s, -1)

    return one(q, q_norm), one(k, k_norm)


@fused_rope.register_fake
def _(q, k, position_ids, q_norm, k_norm, *args):  # noqa: ANN001, ANN202 - shapes only
    return torch.empty_like(q), torch.empty_like(k)


def _rope_onnx(
    q,  # noqa: ANN001 - onnxscript values
    k,  # noqa: ANN001
    position_ids,  # noqa: ANN001
    q_norm,  # noqa: ANN001
    k_norm,  # noqa: ANN001
    head_dim: int,
    rotary_dim: int,
    inv_freq: list[float],
    attention_scale: float,
    interleaved: int,
    norm_eps: float,
    dynamic_factor: float,
    dynamic_max_positions: int,
    rope_theta: float,
    long_inv_freq: list[float],
    long_after: int,
):  # noqa: ANN202
    attrs = ops.rope_attributes(
        head_dim, rotary_dim, inv_freq, attention_scale, interleaved, norm_eps, dynamic_factor,
        dynamic_max_positions, rope_theta, long_inv_freq, long_after)
    if q_norm is None:
        return _fuselm.FusedRoPE(q, k, position_ids, **attrs, _outputs=2)
    return _fuselm.FusedRoPE(q, k, position_ids, q_norm, k_norm, **attrs, _outputs=2)


@torch.library.custom_op("fuselm::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    q_num_heads: int,
    kv_num_heads: int,
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX Attention (opset 23) semantics: 3-D q/k/v, KV concat inside, bool mask, and
    `softcap` (> 0) applied to the scaled scores before the mask, as ONNX's reference does."""
    b, s, _ = q.shape
    qh = q.reshape(b, s, q_num_heads, -1).transpose(1, 2)
    kh = k.reshape(b, s, kv_num_heads, -1).transpose(1, 2)
    vh = v.reshape(b, s, kv_num_heads, -1).transpose(1, 2)
    present_key = torch.cat([past_key, kh], dim=2)
    present_value = torch.cat([past_value, vh], dim=2)
    rep = q_num_heads // kv_num_heads
    keys = present_key.repeat_interleave(rep, dim=1)
    values = present_value.repeat_interleave(rep, dim=1)
    scores = (qh.float() @ keys.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    y = (scores.softmax(-1) @ values.float()).to(q.dtype)
    return y.transpose(1, 2).reshape(b, s, -1), present_key, present_value


@attention.register_fake
def _(q, k, v, mask, past_key, past_value, q_num_heads, kv_num_heads, scale, softcap=0.0):  # noqa: ANN001, ANN202, E501
    b, s, _ = q.shape
    total = past_key.shape[2] + s
    shape = (b, kv_num_heads, total, past_key.shape[3])
    return torch.empty_like(q), past_key.new_empty(shape), past_value.new_empty(shape)


def _attention_onnx(
    q,  # noqa: ANN001
    k,  # noqa: ANN001
    v,  # noqa: ANN001
    mask,  # noqa: ANN001
    past_key,  # noqa: ANN001
    past_value,  # noqa: ANN001
    q_num_heads: int,
    kv_num_heads: int,
    scale: float,
    softcap: float = 0.0,
):  # noqa: ANN202
    # onnxscript always declares Attention's fourth output (qk_matmul_output); the exporter
    # drops it afterwards (onnx_export._drop_unused_outputs) so no runtime computes it.
    extra = {"softcap": float(softcap)} if softcap > 0 else {}
    outs = _onnx.Attention(
        q,
        k,
        v,
        mask,
        past_key,
        past_value,
        q_num_heads=q_num_heads,
        kv_num_heads=kv_num_heads,
        scale=float(scale),
        is_causal=0,
        **extra,
    )
    return outs[0], outs[1], outs[2]


TRANSLATIONS = {
    torch.ops.fuselm.rope.default: _rope_onnx,
    torch.ops.fuselm.attention.default: _attention_onnx,
}
