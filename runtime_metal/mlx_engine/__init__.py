"""The MLX engine: the planned graph, its ops, the compiled decode program and Q4 weights."""
