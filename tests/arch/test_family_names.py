"""Family knowledge lives in the family's module (export/families/): no shared module names a
family. Read from the sources with `ast`: no string in code outside export/families/ (a
docstring is prose, not code) is a registered family's transformers model_type, HF
architecture class or GGUF architecture name; shared code asks the family or the DecoderSpec."""

from __future__ import annotations

import ast

from fuselm.export.family import ARCHITECTURES
from fuselm.export.registry import model_types
from tests.arch.import_graph import modules

# strings equal to a family's name that name something else: GGUF's tokenizer model "llama"
# is its SentencePiece vocabulary format, whatever the model's family
OTHER_MEANING = {("fuselm.export.gguf.tokenizer", "llama")}


def _family_names() -> set[str]:
    names = set(model_types()) | set(ARCHITECTURES)
    names |= {f.gguf_architecture for f in ARCHITECTURES.values() if f.gguf_architecture}
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def named_families(source: str, names: set[str]) -> list[str]:
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return sorted({node.value for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and id(node) not in skip and node.value in names})


def test_no_shared_module_names_a_family() -> None:
    names = _family_names()
    found = {}
    for mod, path in modules().items():
        if mod.startswith("fuselm.export.families."):
            continue
        hits = [n for n in named_families(path.read_text(), names)
                if (mod, n) not in OTHER_MEANING]
        if hits:
            found[mod] = hits
    assert found == {}


def test_the_check_sees_family_names() -> None:
    """The check is live: it finds the families' own names in their modules, and a comparison
    against a family name in code."""
    names = _family_names()
    assert len(set(model_types())) == 9 and "qwen3" in names and "Qwen3ForCausalLM" in names
    families = {m: p for m, p in modules().items() if m.startswith("fuselm.export.families.")}
    assert all(named_families(p.read_text(), names) for m, p in families.items()
               if not m.endswith(".families"))
    assert named_families('"""qwen3 in prose"""\nx = family == "qwen3"\n', names) == ["qwen3"]
