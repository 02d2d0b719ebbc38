"""Errors the runtime raises for bad input: the CLI prints the message, no traceback."""

from __future__ import annotations

from fuselm.errors import FuselmError


class RuntimeUserError(FuselmError):
    """Bad input to the runtime (model, prompt, options); the message names the problem and fix."""


class NonFiniteLogitsError(RuntimeUserError):
    """The model produced NaN/Inf logits: generation stops (validate turns it into a FAIL)."""


class UnsupportedOpError(RuntimeUserError, NotImplementedError):
    """A graph node the op registry has no implementation for."""

    def __init__(self, domain: str, op_type: str, opset: int, node: str = "") -> None:
        where = f" (node {node!r})" if node else ""
        super().__init__(
            f"no implementation for op {domain or 'ai.onnx'}::{op_type} at opset {opset}{where}; "
            "this model uses an op fuselm's runtime does not run — re-convert it with "
            "`fuselm convert`, or run it with --engine onnxruntime"
        )
        self.domain, self.op_type, self.opset = domain, op_type, opset
