"""The process that renders chat templates: Jinja's sandbox configured as transformers
configures it, plus counted loops and sized values, behind a line-per-request pipe.

Run as `python -m fuselm.runtime_metal.template_sandbox` by runtime_metal/chat_template.py,
which owns the time limit (it kills this process). It imports only jinja2, so it starts in a
fraction of a second. One request per line on stdin, one reply per line on stdout, both JSON:

    {"template": str, "context": {...}, "max_chars": int, "max_loops": int, "seconds": float}
    {"text": str}  |  {"error": kind, "limit": name | null, "type": str, "message": str,
                       "retire": bool}

Limits checked here, from inside the template's own execution:
- loops: every `{% for %}` iterates through a counter (the compiler wraps each loop's iterable),
  so nested loops end at `max_loops` iterations in all, long before the time limit;
- size: the rendered text is counted chunk by chunk, and the operators that build a big value in
  one step (`*`, `+`, `**`) are checked before they run, against `max_chars` (and numbers
  against MAX_DIGITS), so `'x' * 10**9` is refused without allocating it;
- recursion: Python's own limit; a RecursionError here is one error reply;
- memory: the address space is capped where the OS enforces it (Linux), so an allocation that
  the checks above miss ends in a MemoryError reply instead of the machine's memory;
- time, as a backstop: an alarm a little after the parent's limit ends this process, should
  the parent be gone before it could kill it (the render would otherwise run on alone).
"""

from __future__ import annotations

import json
import math
import signal
import sys
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes, pass_environment
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_DIGITS = 10_000  # a number the template computes (Python prints at most 4,300 digits)
MEMORY_BYTES = 1 << 30  # the address space of this process, where the OS enforces it
ALARM_GRACE_S = 3  # past the parent's time limit, when SIGALRM ends this process
COUNT_LOOP = "fuselm loop"  # not a name a template can write, so only the compiler uses it
_CACHE = 16  # compiled templates kept (a server renders one template all day)


class LimitExceeded(Exception):
    """A limit this process checks; `limit` names it ("loop", "size")."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class _CountLoops(CodeGenerator):
    """Wraps the iterable of every `{% for %}` in the COUNT_LOOP filter, before the compiler
    collects the filters a template uses (it does so at the start of visit_Template)."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, COUNT_LOOP, [], [], None, None,
                                     lineno=loop.iter.lineno)
        super().visit_Template(node, frame)


class _Generation(Extension):
    """transformers' `{% generation %}` block: a call block that renders its body (transformers
    records the body's position for training masks, which rendering does not need)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """transformers' `dict` global: the constructor and fromkeys, nothing to break out with."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' `namespace`: no underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError("Chat templates cannot store underscore-prefixed attributes on a "
                                f"namespace, but got {name!r}. Please rename the attribute.")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _digits(n: int) -> int:
    return int(abs(n).bit_length() * math.log10(2)) + 1


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox of transformers' `_compile_jinja_template`, with counted loops and sized
    operators. `max_chars` and `max_loops` are set per render (one render at a time here)."""

    code_generator_class = _CountLoops
    intercepted_binops = frozenset({"*", "+", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_Generation, loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters[COUNT_LOOP] = _count_loop
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace
        self.max_chars = self.max_loops = self.loops = 0

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            digits = int(right * math.log10(abs(left))) + 1
            if digits > MAX_DIGITS:
                raise LimitExceeded("size", f"'**' would compute a number of {digits:,} "
                                            f"digits (the limit is {MAX_DIGITS:,})")
        elif operator == "*" and _is_int(left) and _is_int(right):
            if _digits(left) + _digits(right) > MAX_DIGITS + 1:
                raise LimitExceeded("size", "'*' would compute a number of over "
                                            f"{MAX_DIGITS:,} digits")
        elif operator == "*":
            seq, n = (left, right) if _is_int(right) else (right, left)
            if isinstance(seq, (str, list, tuple)) and _is_int(n):
                self._check_size(len(seq) * max(n, 0), "'*'")
        elif isinstance(left, (str, list, tuple)) and type(left) is type(right):
            self._check_size(len(left) + len(right), "'+'")
        return super().call_binop(context, operator, left, right)

    def _check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise LimitExceeded("size", f"{what} would make a value of {size:,} items")

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.loops += 1
            if self.loops > self.max_loops:
                raise LimitExceeded("loop", "")
            yield item

    def render_limited(self, template: jinja2.Template, context: dict[str, Any],
                       max_chars: int, max_loops: int) -> str:
        self.max_chars, self.max_loops, self.loops = max_chars, max_loops, 0
        out: list[str] = []
        size = 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                raise LimitExceeded("size", "its output grew past it")
            out.append(piece)
        return "".join(out)


@pass_environment
def _count_loop(env: LimitedSandbox, iterable: Iterable[Any]) -> Iterator[Any]:
    return env.counted(iterable)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _failure(kind: str, e: BaseException, limit: str | None = None,
             retire: bool = False) -> dict[str, Any]:
    return {"error": kind, "limit": limit, "type": type(e).__name__,
            "message": str(e).strip().splitlines()[0][:500] if str(e).strip() else "",
            "retire": retire}


class Renderer:
    """Compiles (cached) and renders one request."""

    def __init__(self) -> None:
        self.env = LimitedSandbox()
        self.compiled: dict[str, jinja2.Template] = {}

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        source = request["template"]
        try:
            template = self.compiled.get(source) or self.env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            return _failure("syntax", e)
        except RecursionError as e:  # a template nested too deeply for the parser
            return _failure("limit", e, "recursion")
        if len(self.compiled) >= _CACHE:
            self.compiled.clear()
        self.compiled[source] = template
        signal.alarm(math.ceil(request["seconds"]) + ALARM_GRACE_S)
        try:
            text = self.env.render_limited(template, request["context"], request["max_chars"],
                                           request["max_loops"])
        except LimitExceeded as e:
            return _failure("limit", e, e.limit)
        except RecursionError as e:
            return _failure("limit", e, "recursion")
        except MemoryError as e:
            return _failure("limit", e, "memory", retire=True)
        except SecurityError as e:
            return _failure("security", e)
        except jinja2.TemplateError as e:  # raise_exception, an undefined value, ...
            return _failure("template", e)
        except Exception as e:  # noqa: BLE001 - any other error is this template's crash
            return _failure("crash", e)
        finally:
            signal.alarm(0)
        return {"text": text}


def _cap_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    except (ImportError, ValueError, OSError):  # not enforced here (macOS): time bounds it
        pass


def main() -> None:
    _cap_memory()
    renderer = Renderer()
    for line in sys.stdin.buffer:
        try:
            reply = renderer.handle(json.loads(line))
            out = json.dumps(reply, ensure_ascii=True)
        except MemoryError as e:
            out = json.dumps(_failure("limit", e, "memory", retire=True))
        sys.stdout.write(out + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
