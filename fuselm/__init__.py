"""fuselm: Hugging Face decoder LLMs -> fused-op ONNX models, run with MLX or onnxruntime.

The repository keeps its packages in top-level folders (converter/, export/, passes/,
runtime_metal/); installed, they are fuselm.converter, fuselm.export, fuselm.passes and
fuselm.runtime_metal.
"""

__version__ = "0.1.0"
