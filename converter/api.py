"""The public Python API (`import fuselm`): convert a checkpoint, load an artifact, generate.

A thin layer over converter.pipeline and the runtime's one loaded model (runtime_metal/
loaded_model.py: engine, tokenizer, generation loop, text stream);
`fuselm/__init__.py` re-exports these names lazily so `import fuselm` stays light.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuselm.converter.errors import UserError

Messages = Sequence[dict[str, str]]


def convert(src: str | Path, out: str | Path, **options: Any) -> Path:
    """Convert an HF checkpoint folder (or hub id ORG/NAME) into a fused ONNX artifact at `out`.

    Options as ConvertOptions.from_flags takes them: dtype ("auto" | "float32" | "float16"),
    passes, optimize, keep_intermediate, allow_nonfinite, adapter (a PEFT LoRA folder merged
    into the weights), and quant (None | "none" | "q4" | "q8" | "mixed", or a QuantOptions)
    with its flags beside it (q_bits=8, block_size=64, symmetric=True, ...: the keywords of
    passes/quant/options.py's `quant_options`). A quantized GGUF, AWQ or GPTQ checkpoint keeps
    its blocks unless quant="none". Returns the artifact folder."""
    from fuselm.converter.models.hub import resolve_source
    from fuselm.converter.pipeline import ConvertOptions
    from fuselm.converter.pipeline import convert as run_convert

    opts = ConvertOptions.from_flags(**options)
    return run_convert(resolve_source(src), out, opts).out_dir


@dataclass
class Generation:
    """One reply: its text and token ids, why it stopped, and speed figures."""

    text: str
    tokens: list[int]
    stop_reason: str  # eos | stop_string | length
    stats: dict[str, Any] = field(default_factory=dict)
    stop: str | None = None  # the stop string that ended the text


class Model:
    """A loaded artifact. `generate`/`stream` take a prompt string (the chat template is applied
    when the tokenizer has one) or a list of chat messages ({"role", "content"})."""

    def __init__(self, out_dir: str | Path, engine: str = "auto", **engine_options: Any) -> None:
        from fuselm.runtime_metal.loaded_model import open_model

        self.runtime = open_model(out_dir, engine, **engine_options)
        self.path = self.runtime.path
        self.manifest = self.runtime.manifest
        self.engine = self.runtime.engine
        self.tokenizer = self.runtime.tokenizer
        self.eos_ids = self.runtime.eos_ids
        # Successive calls that share a prefix (a growing conversation) reuse the KV cache.
        self._session = self.runtime.session()

    def encode(self, prompt: str | Messages, raw: bool = False) -> list[int]:
        from fuselm.runtime_metal.tokenizer import encode_prompt

        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, raw=raw)
        messages = list(prompt)
        if not messages or messages[-1].get("role") != "user":
            raise UserError("messages must end with a user message")
        return encode_prompt(self.tokenizer, messages[-1]["content"], history=messages[:-1])

    def stream(self, prompt: str | Messages, *, max_tokens: int = 256,
               temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, repetition_penalty: float | None = None,
               seed: int | None = None,
               stop: Sequence[str] = (), raw: bool = False,
               result: list[Generation] | None = None) -> Iterator[str]:
        """Yield the reply's text piece by piece; the finished Generation is appended to
        `result` when given. A sampling option left None is the model's
        generation_config.json's (greedy without do_sample), as in `fuselm run` and `serve`."""
        sampling = self.runtime.sampling_defaults.overridden(
            temperature=temperature, top_k=top_k, top_p=top_p,
            repetition_penalty=repetition_penalty, seed=seed)
        sampling.validate()
        ids = self.encode(prompt, raw=raw)
        done = yield from self._session.stream(ids, max_new_tokens=max_tokens, sampling=sampling,
                                               stop_strings=tuple(stop))
        if result is not None:
            result.append(Generation(done.text, done.tokens, done.stop_reason, {
                "prompt_tokens": len(ids), "prefilled_tokens": done.prompt_tokens,
                "cached_tokens": self._session.reused, "new_tokens": len(done.tokens),
                "prefill_tokens_per_s": done.pp, "decode_tokens_per_s": done.tg,
                "engine": done.engine.get("engine")}, done.stop))

    def generate(self, prompt: str | Messages, **options: Any) -> Generation:
        """The whole reply at once; options as `stream`'s."""
        out: list[Generation] = []
        for _ in self.stream(prompt, result=out, **options):
            pass
        return out[0]


def load(out_dir: str | Path, engine: str = "auto", **engine_options: Any) -> Model:
    """Open a converted artifact. engine: "auto" (MLX on a GPU, onnxruntime otherwise), "mlx"
    or "onnxruntime"; engine_options go to the engine (e.g. accuracy_level=0)."""
    return Model(out_dir, engine, **engine_options)
