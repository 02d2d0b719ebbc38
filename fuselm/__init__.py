"""fuselm: Hugging Face decoder LLMs -> fused-op ONNX models, run with MLX or onnxruntime.

    import fuselm
    fuselm.convert("path/to/hf-model", "out", quant="q4")
    model = fuselm.load("out")
    print(model.generate("Hello", max_tokens=32).text)

The names are loaded on first use, so `import fuselm` does not import torch or MLX.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Generation", "Model", "convert", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fuselm.converter import api

        return getattr(api, name)
    raise AttributeError(f"module 'fuselm' has no attribute {name!r}")
