"""The checkpoint's tensor names against the ones config.json implies, before any export work.

A config with fewer layers than the checkpoint would otherwise drop the extra layers silently (a
different, worse model); a tensor nobody reads means the config and the weights disagree (a
feature the exporter does not know, or the wrong config). Both are errors naming the tensors,
as are tensors the config needs that the checkpoint lacks. Tensors HF itself never loads
(rotary `inv_freq` buffers, a stored lm_head when the embeddings are tied) are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from fuselm.export.errors import ExportError

_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SHOWN = 4  # names listed in a message; the rest are counted


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def check_layer_count(present: Iterable[str], root: Path, num_layers: int,
                      claim: str = "config.json's num_hidden_layers") -> None:
    """Raise ExportError when config.json claims more decoder layers than the checkpoint stores.

    Checked from the tensor table alone, before anything is sized by the claim: a config that
    says 1,000,000 layers over a 2-layer checkpoint otherwise has transformers' config class,
    the per-layer shapes and the traced module built for a million layers (gigabytes, minutes)
    before the missing tensors are noticed. (More layers stored than claimed is reported by
    `check_tensor_names`, with the tensors.)"""
    layers = {int(m.group(1)) for n in present if (m := _LAYER.match(n))}
    stored = max(layers) + 1 if layers else 0
    if num_layers > stored:
        raise ExportError(
            f"{claim} is {num_layers} but the checkpoint in {root} stores {stored} decoder "
            f"layer(s); the two do not match (set it to {stored}, or copy the complete "
            "checkpoint)")


def check_tensor_names(
    expected: Iterable[str], present: Iterable[str], root: Path, num_layers: int, tied: bool
) -> None:
    """Raise ExportError unless the checkpoint holds exactly the tensors the config implies."""
    want, have = set(expected), set(present)
    missing = sorted(want - have)
    if missing:
        raise ExportError(
            f"the checkpoint in {root} is missing {len(missing)} tensor(s) its config.json needs: "
            f"{_names(missing)}; the checkpoint does not match its config.json"
        )
    layers = {int(m.group(1)) for n in have if (m := _LAYER.match(n))}
    if layers and max(layers) + 1 > num_layers:
        raise ExportError(
            f"the checkpoint in {root} has {max(layers) + 1} decoder layers but config.json's "
            f"num_hidden_layers is {num_layers}; the extra layers would be dropped. Set "
            f"num_hidden_layers to {max(layers) + 1}"
        )
    unused = sorted(
        n for n in have - want
        if not _HARMLESS.search(n) and not (tied and n == "lm_head.weight")
    )
    if unused:
        raise ExportError(
            f"the checkpoint in {root} holds {len(unused)} tensor(s) the config does not use: "
            f"{_names(unused)}; the checkpoint does not match its config.json (or uses a "
            "feature fuselm does not export)"
        )
