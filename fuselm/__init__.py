"""fuselm: Hugging Face decoder LLMs -> fused-op ONNX models, run with MLX or onnxruntime.

    import fuselm
    fuselm.convert("path/to/hf-model", "out", quant="q4")
    model, tokenizer = fuselm.load("out")        # or a .gguf file, or an HF folder
    print(fuselm.generate(model, tokenizer, "Hello", max_tokens=32))
    for r in fuselm.stream_generate(model, tokenizer, "Hello", max_tokens=32):
        print(r.text, end="")

The names are loaded on first use, so `import fuselm` does not import torch or MLX.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Generation", "GenerationResponse", "Model", "convert", "generate", "load",
           "stream_generate"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fuselm.converter import api

        return getattr(api, name)
    raise AttributeError(f"module 'fuselm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
