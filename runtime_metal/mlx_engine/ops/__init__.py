"""Op registry: (domain, op_type) -> MLX function. Importing this package registers every op."""

from fuselm.runtime_metal.mlx_engine.ops import attention, elementwise, fused, linear, norm, shape  # noqa: F401
from fuselm.runtime_metal.mlx_engine.ops.registry import OpImpl, lookup, op, registered

__all__ = ["OpImpl", "lookup", "op", "registered"]
