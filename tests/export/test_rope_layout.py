"""Seed step 10: cos/sin must broadcast as [batch, seq, 1, dim] against [batch, seq, heads, dim].

The seed's bug laid them out with unsqueeze(2).unsqueeze(1) ([seq, 1, dim, 1]); with
head_dim != hidden/heads that rotates the wrong axis. These tests compare every FusedRoPE
implementation we ship (NumPy reference, ONNX function body in onnxruntime, torch eager op)
against HF's own apply_rotary_pos_emb, on shapes where a wrong layout cannot pass by accident.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fuselm.export import torch_ops
from fuselm.passes import ops
from fuselm.runtime_metal.validate import rel
from tests.export.helpers import session

B, S, HQ, HK, D = 2, 7, 3, 1, 10  # heads*D = 30 != a "hidden/heads" layout; S, D, HQ all differ


def _hf(q: np.ndarray, k: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray):  # noqa: ANN202
    freqs = pos[..., None].astype(np.float32) * inv_freq
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = torch.tensor(np.cos(emb)), torch.tensor(np.sin(emb))  # [b, s, dim]
    qh = torch.tensor(q.reshape(B, S, HQ, D)).transpose(1, 2)
    kh = torch.tensor(k.reshape(B, S, HK, D)).transpose(1, 2)
    qr, kr = apply_rotary_pos_emb(qh, kh, cos, sin)  # HF's layout: unsqueeze(1) on heads
    return (
        qr.transpose(1, 2).reshape(B, S, -1).numpy(),
        kr.transpose(1, 2).reshape(B, S, -1).numpy(),
    )


def _inputs():  # noqa: ANN202
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, HQ * D)).astype(np.float32)
    k = rng.standard_normal((B, S, HK * D)).astype(np.float32)
    pos = np.stack([np.arange(S) + 5, np.arange(S) * 3]).astype(np.int64)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    return q, k, pos, inv_freq


def test_cos_sin_layout_is_batch_seq_1_dim() -> None:
    _, _, pos, inv_freq = _inputs()
    cos, sin = ops.rope_cos_sin(pos, inv_freq)
    assert cos.shape == sin.shape == (B, S, 1, D)


def test_reference_matches_hf() -> None:
    q, k, pos, inv_freq = _inputs()
    attrs = dict(head_dim=D, rotary_dim=D, inv_freq=inv_freq.tolist())
    for ours, ref in zip(
        ops.fused_rope_reference(q, k, pos, **attrs), _hf(q, k, pos, inv_freq), strict=True
    ):
        assert rel(ours, ref) <= 1e-6


def test_function_body_matches_hf(tmp_path) -> None:
    q, k, pos, inv_freq = _inputs()
    node = helper.make_node(
        "FusedRoPE",
        ["q", "k", "pos"],
        ["qo", "ko"],
        domain=ops.DOMAIN,
        head_dim=D,
        rotary_dim=D,
        inv_freq=inv_freq.tolist(),
        attention_scale=1.0,
        interleaved=0,
        norm_eps=1e-6,
        dynamic_factor=0.0,
        dynamic_max_positions=0,
        rope_theta=10000.0,
    )
    graph = helper.make_graph(
        [node],
        "rope",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, S, HQ * D]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, S, HK * D]),
            helper.make_tensor_value_info("pos", TensorProto.INT64, [B, S]),
        ],
        [
            helper.make_tensor_value_info("qo", TensorProto.FLOAT, [B, S, HQ * D]),
            helper.make_tensor_value_info("ko", TensorProto.FLOAT, [B, S, HK * D]),
        ],
    )
    # IR 10: what onnxruntime 1.30 (the GPU machine's) still reads
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    ops.attach_functions(model)
    onnx.checker.check_model(model)
    path = str(tmp_path / "rope.onnx")
    onnx.save(model, path)
    out = session(path).run(None, {"q": q, "k": k, "pos": pos})
    for ours, ref in zip(out, _hf(q, k, pos, inv_freq), strict=True):
        assert rel(ours, ref) <= 1e-6


def test_torch_eager_op_matches_hf() -> None:
    q, k, pos, inv_freq = _inputs()
    out = torch_ops.fused_rope(
        torch.tensor(q),
        torch.tensor(k),
        torch.tensor(pos),
        None,
        None,
        D,
        D,
        inv_freq.tolist(),
        1.0,
        0,
        1e-6,
        0.0,
        0,
        10000.0,
        [],  # no LongRoPE
        0,
    )
    for ours, ref in zip(out, _hf(q, k, pos, inv_freq), strict=True):
        assert rel(ours.numpy(), ref) <= 1e-6


def test_seed_step10_layout_would_fail() -> None:
    """The seed's [seq, 1, dim, 1] table does not reproduce HF: the check above has teeth."""
    q, k, pos, inv_freq = _inputs()
    freqs = pos[0][:, None].astype(np.float32) * inv_freq
    emb = np.concatenate([freqs, freqs], -1)
    bad_cos = torch.tensor(np.cos(emb)).unsqueeze(2).unsqueeze(1)  # [s, 1, dim, 1]
    qh = torch.tensor(q.reshape(B, S, HQ, D))
    try:
        wrong = (qh * bad_cos).numpy()
    except RuntimeError:
        return  # does not even broadcast: the bug is caught
    good = qh.numpy() * np.cos(emb)[None, :, None, :]
    assert wrong.shape != good.shape or rel(wrong, good) > 1e-3
