"""AWQ and GPTQ checkpoints written in the test, from a float HF folder, by the published packing
rules (AutoAWQ's WQLinear_GEMM.pack, AutoGPTQ's QuantLinear.pack) — not by those packages — and
the float HF folder of the very weights they hold (the ground truth: (q - z) * s in float32).

Codes come from min/max quantization of the float weights; a tenth of the groups then get the
extreme zero points 0 and 15 (their codes clipped), so every nibble value is exercised,
including GPTQ v1's zero point 0 stored as 15.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8j + ORDER[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD = "lm_head"  # packed too with lm_head=True (GPTQModel's `lm_head: true`)


def quantize(w: np.ndarray, group: int, sym: bool, rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [N, K] float → codes [N, K], float16 scales [N, K/G], zero points [N, K/G] (ints)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if sym:
        s = (2 * np.abs(g).max(-1) / 15).astype(np.float16)
        z = np.full(s.shape, 8)
    else:
        lo, hi = g.min(-1), g.max(-1)
        s = ((hi - lo) / 15).astype(np.float16)
        z = np.clip(np.rint(-lo / s.astype(np.float32)), 0, 15).astype(np.int64)
        edge = rng.random(z.shape) < 0.1
        z[edge] = rng.choice([0, 15], int(edge.sum()))
    q = np.rint(g / s.astype(np.float32)[..., None]) + z[..., None]
    return np.clip(q, 0, 15).astype(np.int64).reshape(n, k), s, z


def _pack(values: np.ndarray, axis: int, order: list[int]) -> np.ndarray:
    """Eight 4-bit ints along `axis` into one int32, nibble i holding index ORDER[i]."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    out = np.zeros((*v.shape[:-1], v.shape[-1] // 8), np.uint32)
    for i, c in enumerate(order):
        out |= (v[..., c::8] & 15) << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis)).view(np.int32)


def pack_awq(q: np.ndarray, s: np.ndarray, z: np.ndarray) -> dict[str, np.ndarray]:
    """AutoAWQ GEMM: intweight [K, N] and zeros [K/G, N] packed along N in ORDER."""
    return {"qweight": _pack(q.T, 1, AWQ_ORDER), "qzeros": _pack(z.T, 1, AWQ_ORDER),
            "scales": np.ascontiguousarray(s.T)}


def pack_gptq(q: np.ndarray, s: np.ndarray, z: np.ndarray, group: int,
              v1: bool, g_idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """AutoGPTQ: intweight [K, N] packed along K, zeros [K/G, N] along N, v1 storing z - 1
    (kept to its nibble: AutoGPTQ's own packer would let a -1 spill into the next nibble)."""
    stored = (z - 1) & 15 if v1 else z
    k = q.shape[1]
    return {"qweight": _pack(q.T, 0, list(range(8))), "qzeros": _pack(stored.T, 1,
                                                                       list(range(8))),
            "scales": np.ascontiguousarray(s.T),
            "g_idx": (np.arange(k) // group if g_idx is None else g_idx).astype(np.int32)}


def write_pair(float_dir: Path, out: Path, method: str, group: int, sym: bool = False,
               fmt: str = "gptq", side_file: bool = False, seed: int = 0,
               lm_head: bool = False, act_order: bool = False) -> tuple[Path, Path]:
    """(quantized HF folder, float HF folder of its dequantized weights) under `out`.
    `act_order` (GPTQ): each layer's input channels grouped in a random order, stored in their
    own order with the g_idx naming each one's group (as AutoGPTQ's desc_act leaves them)."""
    rng = np.random.default_rng(seed)
    tensors = load_file(float_dir / "model.safetensors")
    packed: dict[str, np.ndarray] = {}
    ref: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        packs = PROJECTIONS + ((HEAD,) if lm_head else ())
        if name.endswith(".weight") and prefix.split(".")[-1] in packs:
            k = w.shape[1]
            perm = rng.permutation(k) if act_order else np.arange(k)
            q_perm, s, z = quantize(w[:, perm].astype(np.float32), group, sym, rng)
            q, g_idx = np.empty_like(q_perm), np.empty(k, np.int64)
            q[:, perm], g_idx[perm] = q_perm, np.arange(k) // group
            parts = pack_awq(q, s, z) if method == "awq" else pack_gptq(q, s, z, group,
                                                                        fmt == "gptq", g_idx)
            packed.update({f"{prefix}.{part}": v for part, v in parts.items()})
            ref[name] = np.ascontiguousarray(  # a[:, idx] may come back in Fortran order
                (q - z[:, g_idx]) * s.astype(np.float32)[:, g_idx], np.float32)
        else:  # stored in float16, as the hub's quantized checkpoints keep them
            packed[name] = w.astype(np.float16)
            ref[name] = packed[name].astype(np.float32)
    qdir, fdir = out / f"{method}_q", out / f"{method}_ref"
    for d, weights in ((qdir, packed), (fdir, ref)):
        shutil.copytree(float_dir, d)
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    config: dict[str, Any] = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "awq":
        config.update(zero_point=True, version="gemm")
    else:
        config.update(sym=sym, desc_act=act_order, checkpoint_format=fmt, lm_head=lm_head)
    cfg = json.loads((qdir / "config.json").read_text())
    if side_file and method == "awq":  # AutoAWQ's own file and spelling, no quant_method
        (qdir / "quant_config.json").write_text(json.dumps(
            {"zero_point": True, "q_group_size": group, "w_bit": 4, "version": "GEMM"}))
    elif side_file:  # AutoGPTQ's own file beside config.json
        (qdir / "quantize_config.json").write_text(json.dumps(config))
    else:
        cfg["quantization_config"] = config
    cfg["dtype"] = "float16"
    (qdir / "config.json").write_text(json.dumps(cfg))
    return qdir, fdir
