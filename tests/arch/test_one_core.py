"""One generation core, read from the sources: one place opens a model (engine + tokenizer:
runtime_metal/loaded_model.py) and one place turns token ids into text (runtime_metal/
text_stream.py). A second model-opening path or a second detokenizing loop fails here.

The checks follow what the code does, not what it is named: imports are resolved (an alias,
a module attribute, an import inside a function), and a decode is recognised by its call
shape (token ids in, not an encoding name) wherever it is reached from, including a callable
that was bound to a tokenizer's decode and called later.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from tests.arch.import_graph import graph, modules

LOADER = "fuselm.runtime_metal.loaded_model"
TEXT_STREAM = "fuselm.runtime_metal.text_stream"
# What opens a model, and the one module allowed to use it (besides the one defining it).
OPENERS = {
    "fuselm.runtime_metal.engine.make_engine": LOADER,
    "fuselm.runtime_metal.tokenizer.load_tokenizer": LOADER,
    "fuselm.runtime_metal.mlx_engine.engine.MLXEngine": "fuselm.runtime_metal.engine",
    "fuselm.runtime_metal.ort_engine.engine.OrtEngine": "fuselm.runtime_metal.engine",
}
# Tokenizer constructors: the faces (API, CLI, server, runtime) reach a tokenizer only through
# runtime_metal/tokenizer.py's load_tokenizer (conversion code reads checkpoints' tokenizers).
TOKENIZER_CLASSES = ("transformers.AutoTokenizer", "transformers.PreTrainedTokenizerFast",
                     "tokenizers.Tokenizer")
FACES = ("fuselm.converter.api", "fuselm.converter.cli", "fuselm.converter.serve",
         "fuselm.runtime_metal")
# Every face opens its model through the loader (directly or through a module that does).
USERS = ("fuselm.converter.api", "fuselm.converter.cli.run_cmd", "fuselm.converter.cli.chat_cmd",
         "fuselm.converter.cli.serve_cmd", "fuselm.converter.cli.validate_cmd",
         "fuselm.converter.cli.perplexity_cmd", "fuselm.converter.cli.bench_cmd",
         "fuselm.runtime_metal.validate", "fuselm.runtime_metal.perplexity",
         "fuselm.runtime_metal.bench")
# A tokenizer's id -> text methods. `bytes.decode` has the same name: it takes no argument or
# an encoding (a string), which is how it is told apart.
DECODERS = {"decode", "batch_decode", "decode_batch", "convert_ids_to_tokens",
            "convert_tokens_to_string"}
DECODE_FACTORIES = {f"{TEXT_STREAM}.detokenizer", "decoder"}  # return a decode callable


def _aliases(tree: ast.AST, module: str) -> dict[str, str]:
    """Local name -> the qualified name it was imported as (every import in the module)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    out[a.name.partition(".")[0]] = a.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")[:-node.level]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def _qualified(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`a.b.c` with `a` resolved through the imports; None for anything not rooted in one."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def references(source: str, module: str) -> Iterator[tuple[str, int]]:
    """(qualified name, line) of every imported name the module imports or uses."""
    tree = ast.parse(source)
    aliases = _aliases(tree, module)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for full in (_aliases(ast.Module([node], []), module).values()):
                yield full, node.lineno
        elif isinstance(node, ast.Name | ast.Attribute):
            q = _qualified(node, aliases)
            if q is not None:
                yield q, node.lineno


def _is_token_decode(call: ast.Call) -> bool:
    """A call shaped like a tokenizer's decode: ids in (not `bytes.decode()` / ("utf-8"))."""
    if call.args:
        first = call.args[0]
        return not (isinstance(first, ast.Constant) and isinstance(first.value, str))
    return any(k.arg not in ("encoding", "errors") for k in call.keywords)


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def detokenizing_calls(source: str, module: str) -> list[int]:
    """Lines where the module turns token ids into text: a tokenizer decode method or a
    `decode(...)` callable called with ids, or a call of a name bound to a decode callable
    (`f = tok.decode`, `f = detokenizer(tok)`, `f = model.decoder()`, a lambda that decodes)."""
    tree = ast.parse(source)
    aliases = _aliases(tree, module)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            v = node.value
            is_decoder = (
                isinstance(v, ast.Attribute) and v.attr in DECODERS
                or isinstance(v, ast.Call) and (
                    _qualified(v.func, aliases) in DECODE_FACTORIES or _callee(v) == "decoder")
                or isinstance(v, ast.Lambda) and any(
                    isinstance(c, ast.Call) and _callee(c) in DECODERS and _is_token_decode(c)
                    for c in ast.walk(v.body)))
            if is_decoder:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    name = t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", None)
                    if name:
                        bound.add(name)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _callee(node)
            if name in DECODERS and _is_token_decode(node) or name in bound:
                lines.append(node.lineno)
    return sorted(lines)


def _sources() -> Iterator[tuple[str, str]]:
    for mod, path in modules().items():
        yield mod, path.read_text()


def test_one_place_opens_a_model() -> None:
    wrong = []
    for mod, src in _sources():
        for name, line in references(src, mod):
            allowed = OPENERS.get(name)
            if allowed is not None and mod != allowed and not name.startswith(mod + "."):
                wrong.append(f"{mod}:{line} uses {name} (open models with {LOADER}.open_model)")
            if name in TOKENIZER_CLASSES and mod.startswith(FACES) and (
                    mod != "fuselm.runtime_metal.tokenizer"):
                wrong.append(f"{mod}:{line} builds a tokenizer ({name})")
    assert wrong == []


def test_every_face_opens_its_model_through_the_loader() -> None:
    g = graph()

    def reaches(start: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == LOADER:
                return True
            if m not in seen:
                seen.add(m)
                todo += g.get(m, ())
        return False

    assert [m for m in USERS if not reaches(m)] == []


def test_one_place_turns_tokens_into_text() -> None:
    found = {mod: lines for mod, src in _sources() if mod != TEXT_STREAM
             and (lines := detokenizing_calls(src, mod))}
    assert found == {}, "decode token ids only in runtime_metal/text_stream.py (TextStream)"
    assert detokenizing_calls(dict(_sources())[TEXT_STREAM], TEXT_STREAM)  # it is there


# -- the detectors themselves, on the shapes they must and must not catch --------------------
OLD_LOOP = """
def iter_generate(engine, prompt, decode=None):
    tokens = []
    for token in steps:
        tokens.append(token)
        text = decode(tokens)
        yield text
"""
OLD_CLASS = """
class Stream:
    def __init__(self, tok):
        self.decode = lambda t: tok.decode(t, skip_special_tokens=True)
    def push(self, token):
        self.tokens.append(token)
        return self.decode(self.tokens)
"""
BOUND = """
from fuselm.runtime_metal.text_stream import detokenizer as d
def f(tok, ids):
    show = d(tok)
    return show(ids)
"""
NOT_TEXT = """
def f(raw, v, data):
    return raw.decode("utf-8"), v.decode(), data.decode(errors="replace"), engine.decode_step(1)
"""
SECOND_OPENER = """
import fuselm.runtime_metal.tokenizer as t
from fuselm.runtime_metal.engine import make_engine as mk
def open_it(d):
    return mk(d), t.load_tokenizer(d)
"""


def test_the_detectors_catch_what_they_must_and_only_that() -> None:
    assert detokenizing_calls(OLD_LOOP, "fuselm.x") == [6]
    assert detokenizing_calls(OLD_CLASS, "fuselm.x") == [4, 7]
    assert detokenizing_calls(BOUND, "fuselm.x") == [5]
    assert detokenizing_calls(NOT_TEXT, "fuselm.x") == []
    used = {name for name, _ in references(SECOND_OPENER, "fuselm.x")}
    assert {"fuselm.runtime_metal.engine.make_engine",
            "fuselm.runtime_metal.tokenizer.load_tokenizer"} <= used
