"""The summary `fuselm inspect` prints first: what model this is, in a few lines."""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from fuselm.passes.layers import nodes_per_layer

KV = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")


def summary(root: Path, info: dict[str, Any], nodes: list[Any]) -> list[tuple[str, str]]:
    """(label, value) rows; the artifact's fuselm.json adds the model's shapes when present."""
    from fuselm.runtime_metal.artifact import MANIFEST, read_manifest
    from fuselm.runtime_metal.model_size import human, parameter_count

    rows: list[tuple[str, str]] = []
    folder = root if root.is_dir() else root.parent
    if (folder / MANIFEST).is_file():
        man = read_manifest(folder)
        m = man.model
        params = parameter_count(m)
        rows += [("architecture", f"{m.architecture} ({m.family})"),
                 ("parameters", human(params)),
                 ("layers", str(m.num_layers)),
                 ("heads", f"{m.num_heads} query, {m.num_kv_heads} key/value, "
                           f"head_dim {m.head_dim}"),
                 ("hidden / MLP", f"{m.hidden_size} / {m.intermediate_size}"),
                 ("vocabulary", str(m.vocab_size)),
                 ("context", str(m.context_length)),
                 ("dtype", man.dtype)]
        q = man.quantization
        bits = info["weight_bytes"] * 8 / params if params else 0.0
        scheme = "none"
        if q:
            b = q.get("bits", 4)
            kind = f"Q{b}" if isinstance(b, int) else f"{b}-bit"  # e.g. "mixed 4/6/8-bit"
            scheme = (f"{kind} blocks of {q.get('block_size', '?')}, "
                      f"{'symmetric' if q.get('symmetric') else 'asymmetric'}")
        rows += [("quantization", scheme), ("bits / weight", f"{bits:.2f} (all weights)")]
    per_layer = nodes_per_layer(nodes)
    rows.append(("nodes", f"{info['nodes']}" + (f", {per_layer} per layer" if per_layer else "")))
    fused = {k: v for k, v in info["ops"].items() if k.startswith("fuselm.")}
    rows.append(("fuselm ops", ", ".join(f"{k.removeprefix('fuselm.')} x{v}"
                                         for k, v in fused.items()) or "none"))
    rows.append(("weights", f"{info['weight_bytes'] / 1e6:.1f} MB"))
    return rows


def collapse_io(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """past_key_values.{0..29}.key: one row per KV family with the same type and shape."""
    groups: OrderedDict[tuple, list[int]] = OrderedDict()
    out: list[dict[str, Any]] = []
    for r in rows:
        m = KV.match(r["name"])
        if m is None:
            out.append(r)
            continue
        key = (m.group(1), m.group(3), r["type"], str(r["shape"]))
        if key not in groups:
            groups[key] = []
            out.append({"name": key, "type": r["type"], "shape": r["shape"]})
        groups[key].append(int(m.group(2)))
    for r in out:
        if isinstance(r["name"], tuple):
            idx = groups[r["name"]]
            span = f"{{{idx[0]}..{idx[-1]}}}" if idx == list(range(idx[0], idx[-1] + 1)) \
                else "{" + ",".join(map(str, idx)) + "}"
            r["name"] = f"{r['name'][0]}.{span}.{r['name'][1]}"
    return out
