"""The op registry: (domain, op_type) -> a plain function over arrays (tinygrad's shape).

An op function is called as `fn(xp, *inputs, **attrs)`: `xp` is `numpy` when every input is a
host (NumPy) value and the op is marked `host=True` — so shape arithmetic and the tiny
attention-mask subgraph never touch the device or force a sync — and `mlx.core` otherwise.
Missing optional inputs arrive as None. Attributes are filtered to the function's keyword
parameters, so an op states exactly the attributes it honours.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from fuselm.runtime_metal.errors import UnsupportedOpError

OpFn = Callable[..., object]


@dataclass(frozen=True)
class OpImpl:
    domain: str
    op_type: str
    fn: OpFn
    since: int  # the first opset version whose semantics this function implements
    host: bool  # may run in NumPy when all inputs are host values
    static: tuple[int, ...]  # inputs needed as host ints (shapes, axes): never sent to device
    qweight: bool  # accepts a packed Q4 weight (QWeight) as-is
    attrs: frozenset[str] | None  # keyword parameters the function takes (None: **kwargs)


_REGISTRY: dict[tuple[str, str], list[OpImpl]] = {}


def op(
    domain: str,
    op_type: str,
    *,
    since: int = 1,
    host: bool = False,
    static: tuple[int, ...] = (),
    qweight: bool = False,
) -> Callable[[OpFn], OpFn]:
    def register(fn: OpFn) -> OpFn:
        params = inspect.signature(fn).parameters.values()
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        names = frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        impl = OpImpl(domain, op_type, fn, since, host, static, qweight, None if var_kw else names)
        impls = _REGISTRY.setdefault((domain, op_type), [])
        impls.append(impl)
        impls.sort(key=lambda i: i.since)
        return fn

    return register


def lookup(domain: str, op_type: str, opset: int, node: str = "") -> OpImpl:
    """The implementation for `opset` (the newest with since <= opset), or UnsupportedOpError."""
    domain = "" if domain == "ai.onnx" else domain
    best = None
    for impl in _REGISTRY.get((domain, op_type), []):
        if impl.since <= opset:
            best = impl
    if best is None:
        raise UnsupportedOpError(domain, op_type, opset, node)
    return best


def registered() -> list[tuple[str, str]]:
    return sorted(_REGISTRY)
