"""Which quantization an HF folder's weights carry: its `quantization_config`, checked.

transformers writes it into config.json as `quantization_config` (some tools as
`quant_config`); AutoGPTQ writes `quantize_config.json` beside it and AutoAWQ `quant_config.json`
in its own spelling (w_bit, q_group_size), without `quant_method`: the keys tell the method.
The schemes read exactly (export/quantized/packing.py):

    AWQ   quant_method "awq", version "gemm" (AutoAWQ's GEMM packing), zero_point true
    GPTQ  quant_method "gptq", checkpoint_format "gptq" (v1: zero points stored minus one)
          or "gptq_v2", sym true or false, desc_act false (or a g_idx that keeps the
          input channels in order)

both 4 bits in groups of 32, 64 or 128 along the reduction axis. Anything else is refused by
name: another packing would be read as the wrong weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuselm.export.errors import ExportError
from fuselm.export.json_file import read_json

SIDE_FILES = ("quantize_config.json", "quant_config.json")  # AutoGPTQ's, AutoAWQ's
CONFIG_KEYS = ("quantization_config", "quant_config")
GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "awq" | "gptq"
    bits: int
    group_size: int
    sym: bool  # GPTQ: fixed zero point (8); AWQ: always asymmetric
    zeros_minus_one: bool  # GPTQ v1 stores each zero point minus one
    desc_act: bool  # GPTQ act-order: g_idx may reorder the input channels
    where: str  # the file and key the scheme came from, for messages

    def record(self) -> dict[str, Any]:
        """fuselm.json's account of the checkpoint's own quantization."""
        return {"method": self.method, "bits": self.bits, "group_size": self.group_size,
                "sym": self.sym}


def _found(root: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    for key in CONFIG_KEYS:
        if raw.get(key) is not None:
            return raw[key], f"config.json's {key}"
    for name in SIDE_FILES:
        if (root / name).is_file():
            return read_json(root / name, "re-save the quantized checkpoint"), name
    return None


def _side_file_method(qc: dict[str, Any]) -> str:
    """The method of a side file without `quant_method`, by its keys: AutoAWQ's quant_config
    (w_bit, q_group_size, zero_point, version) or AutoGPTQ's quantize_config (desc_act, sym,
    ...); "" when neither."""
    if any(k in qc for k in ("w_bit", "q_group_size", "zero_point", "version")):
        return "awq"
    if any(k in qc for k in ("desc_act", "sym", "damp_percent", "checkpoint_format")):
        return "gptq"
    return ""


def read_scheme(root: Path, raw: dict[str, Any]) -> QuantScheme | None:
    """The scheme of the folder `root` (config.json's contents `raw`); None: float weights."""
    found = _found(root, raw)
    if found is None:
        return None
    qc, where = found
    if not isinstance(qc, dict):
        raise ExportError(f"{root}: {where} is not a JSON object")

    def refuse(what: str) -> ExportError:
        return ExportError(f"{root}: {where} {what}; fuselm imports 4-bit AWQ (GEMM packing) "
                           "and GPTQ checkpoints in groups of 32, 64 or 128")

    method = str(qc.get("quant_method") or _side_file_method(qc)).lower()
    if method not in ("awq", "gptq"):
        raise refuse(f"has quant_method {qc.get('quant_method')!r}")
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise refuse(f"has bits {bits!r}")
    if group not in GROUPS:
        raise refuse(f"has group_size {group!r}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(f"has version {version!r} (another packing than GEMM's)")
        if qc.get("backend", "autoawq") != "autoawq":
            raise refuse(f"has backend {qc.get('backend')!r} (another packing than AutoAWQ's)")
        if not qc.get("zero_point", True):
            raise refuse("has zero_point false (AWQ without zero points)")
        return QuantScheme("awq", 4, group, False, False, False, where)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"has checkpoint_format {fmt!r}")
    return QuantScheme("gptq", 4, group, bool(qc.get("sym", True)), fmt == "gptq",
                       bool(qc.get("desc_act", False)), where)
