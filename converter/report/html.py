"""The HTML page of `fuselm report`: passes, one decoder layer before and after fusion,
per-op time, per-tensor Q4 error. Self-contained (inline CSS and SVG, no scripts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from fuselm.converter.report.svg_charts import bar_chart, layer_drawing, paired_bars

CSS = """body{font:14px system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}.num{text-align:right}.muted{color:#777}
svg text{font:12px system-ui,sans-serif}.layers{display:flex;gap:24px;flex-wrap:wrap;
align-items:flex-start}.layers figure{margin:0}.scroll{overflow-x:auto}"""


@dataclass
class ReportData:
    title: str
    summary: list[tuple[str, str]]
    passes: list[dict[str, Any]]  # fuselm.json's pass entries
    hist_before: dict[str, int]
    hist_after: dict[str, int]
    layer_before: list[dict[str, Any]]
    layer_after: list[dict[str, Any]]
    profile: list[dict[str, Any]] | None = None  # Profiler.by_op() rows
    profile_note: str = ""
    quant_errors: dict[str, float] | None = None
    quant_note: str = ""
    notes: list[str] = field(default_factory=list)


def _unchanged(e: dict[str, Any]) -> str:
    """Why a pass changed nothing: with no match, its pattern was not in the graph it got (the
    graph builder writes RMSNormalization, FusedRoPE and Attention itself)."""
    why = "no match: none of its pattern in the graph" if not e.get("matches") else "no change"
    return f"<span class=muted>{why}</span>"


def _passes_table(passes: list[dict[str, Any]]) -> str:
    rows = []
    for e in passes:
        delta = ", ".join(f"{escape(k)} {v:+d}" for k, v in e.get("op_delta", {}).items())
        refused = "<br>".join(f"{escape(str(n))}: {escape(str(r))}"
                              for n, r in e.get("refused", [])[:8])
        if len(e.get("refused", [])) > 8:
            refused += f"<br>(+{len(e['refused']) - 8} more)"
        rows.append(f"<tr><td>{escape(e['name'])}</td><td class=num>{e['matches']}</td>"
                    f"<td class=num>{e['nodes_before']} → {e['nodes_after']}</td>"
                    f"<td>{delta or _unchanged(e)}</td>"
                    f"<td>{refused or '<span class=muted>none</span>'}</td>"
                    f"<td class=num>{e.get('seconds', 0):.3f}</td></tr>")
    return ("<table id=passes><tr><th>pass</th><th>matches</th><th>nodes</th>"
            "<th>ops +/-</th><th>refused</th><th>s</th></tr>" + "".join(rows) + "</table>")


def render(d: ReportData) -> str:
    summary = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>"
                      for k, v in d.summary)
    ops = sorted(set(d.hist_before) | set(d.hist_after),
                 key=lambda k: -max(d.hist_before.get(k, 0), d.hist_after.get(k, 0)))
    hist = paired_bars([(k, d.hist_before.get(k, 0), d.hist_after.get(k, 0)) for k in ops],
                       "histogram")
    before = layer_drawing(d.layer_before, "layer-before")
    after = layer_drawing(d.layer_after, "layer-after")
    if d.profile:
        prof = bar_chart([(r["op"], float(r["total_ms"])) for r in d.profile], "ms", "profile")
        prof += f"<p class=muted>{escape(d.profile_note)}</p>"
    else:
        prof = f"<p id=profile-missing class=muted>{escape(d.profile_note)}</p>"
    if d.quant_errors:
        worst = sorted(d.quant_errors.items(), key=lambda kv: -kv[1])
        quant = bar_chart(worst, "rel", "quant-error", label_width=360)
        quant += f"<p class=muted>{escape(d.quant_note)}</p>"
    else:
        quant = f"<p id=quant-missing class=muted>{escape(d.quant_note)}</p>"
    n_before, n_after = len(d.layer_before), len(d.layer_after)
    notes = "".join(f"<p class=muted>{escape(n)}</p>" for n in d.notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(d.title)}</title>
<style>{CSS}</style></head><body>
<h1>{escape(d.title)}</h1>{notes}
<table id=summary>{summary}</table>
<h2>Passes</h2>{_passes_table(d.passes)}
<h2>Op histogram, before → after the passes</h2><div class=scroll>{hist}</div>
<h2>One decoder layer, as exported and after the passes</h2>
<div class=layers><figure><figcaption>as exported, before the passes ({n_before} nodes)</figcaption>
<div class=scroll>{before or '<p class=muted>not recorded</p>'}</div></figure>
<figure><figcaption>after the passes ({n_after} nodes; fuselm ops in orange)</figcaption>
<div class=scroll>{after or '<p class=muted>no layer found</p>'}</div></figure></div>
<h2>Time per op (MLX executor, node by node)</h2>{prof}
<h2>Q4 error per tensor</h2>{quant}
</body></html>
"""
