"""The packages' structure, read from their sources: no import cycles inside runtime_metal,
export/ and runtime_metal/ take only the op contract (passes.ops) from passes/, no package
imports another in a cycle, and no module reaches into another's private (`_name`) names."""

from __future__ import annotations

import ast

from tests.arch.import_graph import ROOT, cycles, graph, modules


def test_no_import_cycles_in_runtime_metal() -> None:
    assert cycles(graph(), "fuselm.runtime_metal") == []


def test_export_and_runtime_take_only_the_op_contract_from_passes() -> None:
    g = graph()
    wrong = sorted((a, b) for a, deps in g.items() for b in deps
                   if a.startswith(("fuselm.export", "fuselm.runtime_metal"))
                   and b.startswith("fuselm.passes") and b not in ("fuselm.passes",
                                                                    "fuselm.passes.ops"))
    assert wrong == []


def test_packages_form_no_cycle() -> None:
    """At package level (converter, export, passes, runtime_metal): a DAG."""
    def package(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2])

    edges: dict[str, set[str]] = {}
    for a, deps in graph().items():
        edges.setdefault(package(a), set()).update(
            package(b) for b in deps if package(b) != package(a))
    for p in list(edges):
        for q in list(edges[p]):
            edges.setdefault(q, set())
    assert cycles(edges, "fuselm") == []


def _private_uses(path_text: str, own: str, known: set[str]) -> list[str]:
    tree = ast.parse(path_text)
    aliases: dict[str, str] = {}  # local name -> fuselm module it names
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fuselm"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in known:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and node.module != own:
                    out.append(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            out.append(f"{aliases[node.value.id]}.{node.attr}")
    return out


def test_no_private_names_across_modules_in_runtime_metal() -> None:
    known = modules()
    found = {}
    for mod, path in known.items():
        if mod.startswith("fuselm.runtime_metal"):
            uses = _private_uses(path.read_text(), mod, set(known))
            if uses:
                found[mod] = uses
    assert found == {}


def test_the_graph_sees_every_module() -> None:
    """The checks above cover real files: the walk finds the runtime's core modules."""
    known = modules()
    for m in ("fuselm.runtime_metal.mlx_engine.step", "fuselm.runtime_metal.mlx_engine.attention",
              "fuselm.runtime_metal.kv_cache", "fuselm.runtime_metal.mlx_engine.ops.attention"):
        assert m in known and known[m].is_relative_to(ROOT)
