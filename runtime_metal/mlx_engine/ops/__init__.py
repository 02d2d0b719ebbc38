"""Op registry: (domain, op_type) -> MLX function. Importing this package registers every op."""

from fuselm.runtime_metal.mlx_engine.ops import (  # noqa: F401
    attention,
    collective,
    elementwise,
    fused,
    linear,
    norm,
    shape,
)
from fuselm.runtime_metal.mlx_engine.ops.registry import OpImpl, lookup, op, registered

__all__ = ["OpImpl", "lookup", "op", "registered"]
