"""The runtime configuration is read in one place: no module of the four packages or of fuselm/
but fuselm/config.py reads a `FUSELM_*` environment variable (os.environ[...], .get, .pop,
.setdefault, `in`, os.getenv; any .get/.pop/.setdefault of such a key), whether it names the
variable by a literal, an f-string or a name bound to one in its module. Read from the sources with
`ast`, nothing imported."""

from __future__ import annotations

import ast

from tests.arch.import_graph import modules

CONFIG_MODULE = "fuselm.config"
PREFIX = "FUSELM_"


def _names_of_settings(tree: ast.Module) -> set[str]:
    """Names bound to a FUSELM_* string, or to anything holding one or such a name
    (ENV = "FUSELM_X"; for env in (ENV, OTHER): ...), anywhere in the module."""
    def holds(node: ast.AST, named: set[str]) -> bool:
        return any((isinstance(n, ast.Constant) and isinstance(n.value, str)
                    and n.value.startswith(PREFIX))
                   or (isinstance(n, ast.Name) and n.id in named) for n in ast.walk(node))

    named: set[str] = set()
    while True:
        found = set(named)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
            elif isinstance(node, ast.For | ast.comprehension):
                targets, value = [node.target], node.iter
            else:
                continue
            if holds(value, named):
                found.update(t.id for tg in targets for t in ast.walk(tg)
                             if isinstance(t, ast.Name))
        if found == named:
            return named
        named = found


def _is_environ(node: ast.AST) -> bool:
    """os.environ, or a bare `environ` (from os import environ)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def _is_getenv(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "getenv")
            or (isinstance(node, ast.Name) and node.id == "getenv"))


def setting_reads(source: str) -> list[int]:
    """Line numbers where `source` reads a FUSELM_* environment variable."""
    tree = ast.parse(source)
    named = _names_of_settings(tree)

    def names_setting(arg: ast.AST) -> bool:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.startswith(PREFIX)
        if isinstance(arg, ast.JoinedStr):  # f"FUSELM_{x}"
            first = arg.values[0] if arg.values else None
            return (isinstance(first, ast.Constant) and isinstance(first.value, str)
                    and first.value.startswith(PREFIX))
        return isinstance(arg, ast.Name) and arg.id in named

    lines = []
    for node in ast.walk(tree):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Call):
            # any .get/.pop/.setdefault of a FUSELM_* key too: os.environ under another name
            f = node.func
            if _is_getenv(f) or (isinstance(f, ast.Attribute) and (
                    _is_environ(f.value) or f.attr in ("get", "pop", "setdefault"))):
                keys = node.args[:1]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys = [node.left]
        if any(names_setting(k) for k in keys):
            lines.append(node.lineno)
    return lines


def test_only_the_config_module_reads_fuselm_variables() -> None:
    found = {}
    for mod, path in modules().items():
        if mod != CONFIG_MODULE:
            lines = setting_reads(path.read_text())
            if lines:
                found[mod] = lines
    assert found == {}


def test_the_scan_sees_every_form_of_read() -> None:
    """The checker itself: each way of reading a FUSELM_* variable is found, other variables
    and plain strings are not."""
    reads = [
        'import os\nos.environ.get("FUSELM_X", "")',
        'import os\nos.environ["FUSELM_X"]',
        'import os\nos.getenv("FUSELM_X")',
        'from os import environ\nenviron.get("FUSELM_X")',
        'import os\nENV = "FUSELM_X"\nos.environ.get(ENV)',
        'import os\nENV: str = "FUSELM_X"\nENV in os.environ',
        'import os\nname = "X"\nos.environ.get(f"FUSELM_{name}")',
        'import os\nenv = os.environ\nenv.get("FUSELM_X")',
        'import os\nA = "FUSELM_A"\nfor e in (A, "FUSELM_B"):\n    os.environ.get(e, "")',
    ]
    for source in reads:
        assert setting_reads(source), source
    others = [
        'import os\nos.environ.get("HOME")',
        'import os\nos.environ["MLX_MAX_OPS_PER_BUFFER"] = "60"',
        'msg = "set FUSELM_EXPORT=torch"',
    ]
    for source in others:
        assert not setting_reads(source), source
