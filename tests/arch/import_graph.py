"""The import graph of the four packages, from their sources (`ast`, nothing imported).

Every `import` counts: module level, inside functions (a lazy import hides a cycle, it does not
remove it) and under TYPE_CHECKING (a type-only cycle is still two modules that know each
other). Run as a script to print the cycles: `python -m tests.arch.import_graph`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"converter": "converter", "export": "export", "passes": "passes",
            "runtime_metal": "runtime_metal", "fuselm": "fuselm"}


def modules() -> dict[str, Path]:
    """fuselm.* module name -> source file."""
    out: dict[str, Path] = {}
    for sub, folder in PACKAGES.items():
        base = "fuselm" if sub == "fuselm" else f"fuselm.{sub}"
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([base, *parts])] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module prefix of `name` (from a.b import c: a.b.c or a.b)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                hit = _resolve(t, known)
                if hit is not None and hit != mod and not mod.startswith(hit + "."):
                    edges[mod].add(hit)  # a package's own __init__ is not a dependency edge
    return edges


def cycles(edges: dict[str, set[str]], within: str = "fuselm") -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), restricted to modules
    under `within`."""
    nodes = [n for n in edges if n == within or n.startswith(within + ".")]
    keep = set(nodes)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in keep:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in nodes:
        if n not in index:
            visit(n)
    return out


def cycle_edges(edges: dict[str, set[str]], comps: list[list[str]]) -> list[tuple[str, str]]:
    """Edges inside the cyclic components (each one is part of some cycle)."""
    out = []
    for comp in comps:
        members = set(comp)
        out += sorted((a, b) for a in comp for b in edges[a] if b in members)
    return out


if __name__ == "__main__":
    g = graph()
    comps = cycles(g)
    for c in comps:
        print("cycle:", " ".join(m.removeprefix("fuselm.") for m in c))
    inner = cycle_edges(g, comps)
    print(f"{len(comps)} cyclic components, {sum(map(len, comps))} modules, "
          f"{len(inner)} edges inside them")
