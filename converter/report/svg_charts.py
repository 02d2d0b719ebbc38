"""Small self-contained SVG drawings for the HTML report: horizontal bar charts and a
layered drawing of a node graph. No JavaScript, no external files."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

FUSED = "#f4a261"  # fuselm ops
PLAIN = "#8ecae6"
BAR = "#457b9d"


def shown(value: float, unit: str) -> str:
    """A value as people read it: milliseconds as µs, ms, s or min, three significant digits
    (35,700 ms is "35.7 s", not "3.57e+04 ms"); other units as before."""
    if unit == "ms":
        for limit, scale, name in ((1.0, 1e3, "µs"), (1e3, 1.0, "ms"), (6e4, 1e-3, "s")):
            if abs(value) < limit:
                return f"{value * scale:.3g} {name}"
        return f"{value / 6e4:.3g} min"
    return f"{value:.3g} {unit}"


def bar_chart(rows: Sequence[tuple[str, float]], unit: str, css_id: str,
              label_width: int = 220) -> str:
    """One bar per (label, value), longest first as given."""
    if not rows:
        return ""
    top = max(v for _, v in rows) or 1.0
    h, width = 22, 420
    parts = [f'<svg id="{css_id}" class="chart" xmlns="http://www.w3.org/2000/svg" '
             f'width="{label_width + width + 110}" height="{h * len(rows) + 10}">']
    for i, (label, value) in enumerate(rows):
        y = 5 + i * h
        w = max(1.0, width * value / top)
        parts.append(f'<text x="{label_width - 6}" y="{y + 15}" text-anchor="end">'
                     f'{escape(label)}</text>'
                     f'<rect x="{label_width}" y="{y + 3}" width="{w:.1f}" height="{h - 6}" '
                     f'fill="{BAR}"><title>{escape(label)}: {value:g} {unit}</title></rect>'
                     f'<text x="{label_width + w + 6:.1f}" y="{y + 15}">'
                     f'{escape(shown(value, unit))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def paired_bars(rows: Sequence[tuple[str, int, int]], css_id: str) -> str:
    """Per op: a 'before' and an 'after' bar (counts)."""
    if not rows:
        return ""
    top = max(max(a, b) for _, a, b in rows) or 1
    h, width, lw = 30, 360, 220
    parts = [f'<svg id="{css_id}" class="chart" xmlns="http://www.w3.org/2000/svg" '
             f'width="{lw + width + 80}" height="{h * len(rows) + 30}">'
             f'<rect x="{lw}" y="4" width="12" height="10" fill="#bbb"/>'
             f'<text x="{lw + 16}" y="13">before passes</text>'
             f'<rect x="{lw + 130}" y="4" width="12" height="10" fill="{BAR}"/>'
             f'<text x="{lw + 146}" y="13">after</text>']
    for i, (op, before, after) in enumerate(rows):
        y = 22 + i * h
        parts.append(f'<text x="{lw - 6}" y="{y + 17}" text-anchor="end">{escape(op)}</text>')
        for j, (v, colour) in enumerate(((before, "#bbb"), (after, BAR))):
            w = width * v / top
            parts.append(f'<rect x="{lw}" y="{y + 3 + j * 12}" width="{max(w, 0.5):.1f}" '
                         f'height="11" fill="{colour}"><title>{escape(op)}: {v}</title></rect>'
                         f'<text x="{lw + w + 4:.1f}" y="{y + 12 + j * 12}" '
                         f'font-size="10">{v}</text>')
    parts.append("</svg>")
    return "".join(parts)


def layer_drawing(nodes: Sequence[dict[str, Any]], css_id: str) -> str:
    """Nodes as boxes in rows by depth (longest path from the layer's inputs), edges where
    one node's output feeds another inside the layer."""
    if not nodes:
        return ""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n["outputs"]:
            producer[o] = i
    depth: list[int] = []
    edges: list[tuple[int, int]] = []
    for i, n in enumerate(nodes):
        srcs = [producer[x] for x in n["inputs"] if x in producer and producer[x] < i]
        edges += [(s, i) for s in srcs]
        depth.append(1 + max((depth[s] for s in srcs), default=-1))
    rows: dict[int, list[int]] = {}
    for i, d in enumerate(depth):
        rows.setdefault(d, []).append(i)
    bw, bh, gx, gy = 150, 26, 18, 46
    widest = max(len(r) for r in rows.values())
    width = widest * (bw + gx) + gx + 120  # room on the right for the skip edges
    height = len(rows) * gy + gx
    pos: dict[int, tuple[float, float]] = {}
    for d, members in rows.items():
        offset = (width - 120 - len(members) * (bw + gx)) / 2
        for k, i in enumerate(members):
            pos[i] = (offset + gx / 2 + k * (bw + gx), gx / 2 + d * gy)
    parts = [f'<svg id="{css_id}" class="graph" xmlns="http://www.w3.org/2000/svg" '
             f'width="{width:.0f}" height="{height:.0f}">'
             '<defs><marker id="arrow-' + css_id + '" viewBox="0 0 10 10" refX="10" refY="5" '
             'markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" '
             'fill="#666"/></marker></defs>']
    for s, t in edges:
        (x1, y1), (x2, y2) = pos[s], pos[t]
        a, b = (x1 + bw / 2, y1 + bh), (x2 + bw / 2, y2)
        if depth[t] - depth[s] > 1:  # a skip edge (the residual): bow out past the boxes
            bow = bw / 2 + 30 + 6 * (depth[t] - depth[s])
            path = (f"M{a[0] + bw / 2:.1f},{y1 + bh / 2:.1f} C{a[0] + bow:.1f},{y1 + bh:.1f} "
                    f"{b[0] + bow:.1f},{y2:.1f} {b[0] + bw / 2:.1f},{y2 + bh / 2:.1f}")
        else:
            path = f"M{a[0]:.1f},{a[1]:.1f} L{b[0]:.1f},{b[1]:.1f}"
        parts.append(f'<path d="{path}" fill="none" stroke="#666" '
                     f'marker-end="url(#arrow-{css_id})"/>')
    for i, n in enumerate(nodes):
        x, y = pos[i]
        fused = n.get("domain") == "fuselm"
        label = n["op"] if len(n["op"]) <= 20 else n["op"][:19] + "…"
        parts.append(f'<g class="node"><rect x="{x:.1f}" y="{y:.1f}" width="{bw}" '
                     f'height="{bh}" rx="5" fill="{FUSED if fused else PLAIN}" stroke="#333">'
                     f'<title>{escape(n["name"])} ({escape(n["op"])})</title></rect>'
                     f'<text x="{x + bw / 2:.1f}" y="{y + 17:.1f}" text-anchor="middle">'
                     f'{escape(label)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
