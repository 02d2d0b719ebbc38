"""An AWQ or GPTQ checkpoint read like a float one, in HF tensor names.

Each quantized linear layer `P` is stored as `P.qweight`, `P.qzeros`, `P.scales` (and GPTQ's
`P.g_idx`); this checkpoint answers for `P.weight` instead: its shape [N, K], its exact blocks
(`given_blocks`, export/quantized/packing.py: codes, float16 scales and integer zero points,
which the quantize pass stores as they are), or its dequantized float32 values (`array`, for a
float conversion or where blocks are not kept). Every other tensor (embeddings, norms, biases,
an unquantized LM head) is read from the safetensors as usual. Every layer's tensors are
checked (present, dtypes, shapes consistent with the scheme, GPTQ's g_idx) when the checkpoint
opens, before anything is written. A GPTQ act-order layer (a g_idx that groups input channels
out of order) has no blocks fuselm can keep: it is refused, unless the conversion asked for
float or re-quantized weights (`dequantize_act_order`), and then read as its dequantized values
W[n, k] = (q[n, k] - z[n, g_idx[k]]) * s[n, g_idx[k]].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fuselm.export.checkpoint_view import CheckpointView
from fuselm.export.errors import ExportError
from fuselm.export.quantized.packing import awq_blocks, gptq_blocks, trivial_groups
from fuselm.export.quantized.scheme import QuantScheme
from fuselm.export.safetensors.checkpoint import Checkpoint
from fuselm.given_blocks import GivenBlocks

if TYPE_CHECKING:
    import torch

_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class LayerInfo:
    """What the exporters ask of a quantized layer's weight."""

    name: str
    shape: tuple[int, int]  # [N, K]
    dtype: np.dtype


class QuantizedCheckpoint(CheckpointView):
    """A safetensors checkpoint whose linear layers are AWQ / GPTQ packed (see the module)."""

    def __init__(self, base: Checkpoint, scheme: QuantScheme,
                 dequantize_act_order: bool = False) -> None:
        super().__init__(base)
        self.scheme = scheme
        self.dequantize_act_order = dequantize_act_order
        self.act_order: set[str] = set()  # layers whose g_idx reorders the input channels
        prefixes = sorted(n.removesuffix(".qweight") for n in base.tensors
                          if n.endswith(".qweight"))
        if not prefixes:
            raise ExportError(f"{self.root}: {scheme.where} says {scheme.method.upper()} but no "
                              "tensor is packed (*.qweight); the config does not match the "
                              "weights")
        self.layers = {f"{p}.weight": self._check_layer(p) for p in prefixes}
        hidden = {f"{p}.{part}" for p in prefixes for part in _PARTS}
        self._tensors: dict[str, Any] = {n: i for n, i in base.tensors.items()
                                         if n not in hidden}
        self._tensors.update(self.layers)

    def _fail(self, prefix: str, what: str) -> ExportError:
        return ExportError(f"{self.root}: {self.scheme.method.upper()} layer {prefix} {what}; "
                           "the checkpoint is damaged or not in the format its "
                           f"{self.scheme.where} names")

    def _check_layer(self, p: str) -> LayerInfo:
        s, b = self.scheme, self.base
        for part in ("qweight", "qzeros", "scales"):
            if not b.has(f"{p}.{part}"):
                raise self._fail(p, f"has no {part}")
        if b.has(f"{p}.weight"):
            raise self._fail(p, "has both a float weight and a packed qweight")
        dtypes = {part: b.info(f"{p}.{part}").dtype.name for part in ("qweight", "qzeros",
                                                                      "scales")}
        if dtypes != {"qweight": "int32", "qzeros": "int32", "scales": "float16"}:
            raise self._fail(p, f"has dtypes {dtypes}; int32 qweight and qzeros and float16 "
                             "scales expected")
        qw, qz, sc = (b.shape(f"{p}.{part}") for part in ("qweight", "qzeros", "scales"))
        if len(sc) != 2 or len(qw) != 2:
            raise self._fail(p, "has packed tensors that are not 2-D")
        groups, n = sc
        k = qw[0] if s.method == "awq" else qw[0] * 8
        want_qw = (k, n // 8) if s.method == "awq" else (k // 8, n)
        if (n % 8 or k != groups * s.group_size or tuple(qw) != want_qw
                or tuple(qz) != (groups, n // 8)):
            raise self._fail(p, f"has qweight {list(qw)}, qzeros {list(qz)}, scales {list(sc)}, "
                             f"which do not fit {s.bits}-bit groups of {s.group_size}")
        if s.method == "gptq" and b.has(f"{p}.g_idx"):
            g_idx = b.array(f"{p}.g_idx").astype(np.int64)
            if g_idx.shape != (k,) or g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= groups:
                raise self._fail(p, f"has a g_idx of shape {list(g_idx.shape)} or values "
                                 f"outside 0..{groups - 1}")
            if not trivial_groups(g_idx, s.group_size):
                if not self.dequantize_act_order:
                    raise ExportError(
                        f"{self.root}: GPTQ layer {p} uses act-order (desc_act: its g_idx groups "
                        "input channels out of order), whose blocks fuselm cannot keep: its "
                        "blocks are runs of adjacent channels. Convert with --quant none (the "
                        "dequantized weights in float) or --quant q4 (quantized again), or "
                        "re-quantize with desc_act=false")
                self.act_order.add(f"{p}.weight")
        return LayerInfo(f"{p}.weight", (n, k), np.dtype(np.float16))

    @property
    def quantized(self) -> bool:
        """Whether the checkpoint gives blocks (always: every AWQ / GPTQ folder has packed
        layers); its conversion keeps them by default."""
        return True

    @property
    def tensors(self) -> dict[str, Any]:
        return self._tensors

    def has(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> Any:
        return self.layers[name] if name in self.layers else self.base.info(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def given_blocks(self, name: str) -> GivenBlocks | None:
        """The layer's blocks exactly as stored, [N, K]; None for a tensor stored in float and
        for an act-order layer (its groups are not runs of adjacent channels)."""
        if name not in self.layers or name in self.act_order:
            return None
        return self._blocks(name)

    def _blocks(self, name: str) -> GivenBlocks:
        p, b, s = name.removesuffix(".weight"), self.base, self.scheme
        qweight, qzeros, scales = (b.array(f"{p}.{part}")
                                   for part in ("qweight", "qzeros", "scales"))
        if s.method == "awq":
            return awq_blocks(qweight, qzeros, scales, s.group_size)
        return gptq_blocks(qweight, qzeros, scales, s.group_size, s.zeros_minus_one)

    def array(self, name: str) -> np.ndarray:
        if name not in self.layers:
            return self.base.array(name)
        if name not in self.act_order:
            return self._blocks(name).dequantize()
        # act-order: blocks [N, K/G] read in stored group order, channel k in group g_idx[k]
        blocks = self._blocks(name)
        g_idx = self.base.array(f"{name.removesuffix('.weight')}.g_idx").astype(np.int64)
        zeros = blocks.zero_points.astype(np.float32)[:, g_idx]  # type: ignore[union-attr]
        w = (blocks.codes.astype(np.float32) - zeros) * blocks.scales[:, g_idx]
        return np.ascontiguousarray(w)  # a[:, idx] may come back in Fortran order

    def get(self, name: str) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.array(name)) if name in self.layers else self.base.get(name)

    def same_values(self, a: str, b: str) -> bool:
        if a in self.layers or b in self.layers:
            return bool(np.array_equal(self.array(a), self.array(b)))
        return self.base.same_values(a, b)
