"""fuselm's fused CUDA kernels for MLX-CUDA: their sources, header files and when they are used."""
