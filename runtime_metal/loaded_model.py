"""One loaded model: the single way every face (`fuselm.load()`, run, chat, serve, validate,
perplexity, bench) opens an artifact for inference.

`open_model` returns a LoadedModel holding the artifact's manifest, the engine, the tokenizer,
the generation config and the EOS set, and hands out what generating needs from them — the
text stream (runtime_metal/text_stream.py), the generation loop with this model's stop rules
filled in, a cached session for multi-turn use, so no face assembles them itself
(tests/arch/test_one_core.py keeps it so).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from fuselm.runtime_metal.artifact import Manifest, read_manifest
from fuselm.runtime_metal.constraint import TokenConstraint, constraint_vocab
from fuselm.runtime_metal.engine import Engine, make_engine, resolve_engine
from fuselm.runtime_metal.generate import GenerationResult, generate, iter_generate
from fuselm.runtime_metal.sampling import SamplingOptions, sampling_defaults
from fuselm.runtime_metal.session import CachedSession
from fuselm.runtime_metal.text_stream import Decode, detokenizer
from fuselm.runtime_metal.tokenizer import eos_ids, generation_config, load_tokenizer


class LoadedModel:
    """An opened artifact. The engine is built at open, or on first use of `engine` when
    opened with defer_engine (serve builds it on its engine thread: MLX binds its streams to
    the thread that makes them). The tokenizer is loaded on first use: bench and perplexity
    of an artifact without tokenizer files never ask for it."""

    def __init__(self, out_dir: str | Path, engine: str, engine_options: dict[str, Any]
                 ) -> None:
        self.path = Path(out_dir)
        self.manifest: Manifest = read_manifest(out_dir)
        self.engine_name = resolve_engine(engine, engine_options.get("parallel"))
        self._engine_options = engine_options
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = make_engine(self.path, self.engine_name, **self._engine_options)
        return self._engine

    @property
    def has_tokenizer(self) -> bool:
        """Whether the artifact carries a tokenizer (without one: token ids in and out)."""
        return (self.path / "tokenizer.json").is_file()

    @cached_property
    def tokenizer(self) -> Any:  # a transformers tokenizer
        return load_tokenizer(self.path)

    def new_tokenizer(self) -> Any:
        """Another instance of the tokenizer, for another thread (a fast tokenizer is not
        safe to share across threads)."""
        return load_tokenizer(self.path)

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        return generation_config(self.path)

    @cached_property
    def sampling_defaults(self) -> SamplingOptions:
        """What generation_config.json asks for (greedy without it): the sampling of a run,
        chat or server request that sets none."""
        return sampling_defaults(self.generation_config)

    @cached_property
    def eos_ids(self) -> list[int]:
        """Every EOS the model declares: manifest, generation config and tokenizer."""
        return eos_ids(self.manifest, self.generation_config, self._text_tokenizer())

    def decoder(self) -> Decode:
        """Token ids -> text, what the text stream decodes with (loads the tokenizer)."""
        return detokenizer(self.tokenizer)

    def generation_options(self) -> dict[str, Any]:
        """The generation loop's options that come from the model: the EOS set, the text
        stream's decode (none without a tokenizer: token ids only) and the context length."""
        return {"eos_ids": self.eos_ids,
                "decode": self.decoder() if self._text_tokenizer() is not None else None,
                "context_length": self.manifest.model.context_length}

    def stream(self, prompt: Sequence[int], **options: Any
               ) -> Generator[str, None, GenerationResult]:
        """`iter_generate` after `prompt` (ids) from an empty cache, with this model's stop
        rules; options are iter_generate's (max_new_tokens, sampling, stop_strings, ...)."""
        return iter_generate(self.engine, prompt, **{**self.generation_options(), **options})

    def generate(self, prompt: Sequence[int], on_text: Callable[[str], None] | None = None,
                 **options: Any) -> GenerationResult:
        """The whole generation; text pieces go to `on_text` as they become final."""
        return generate(self.engine, prompt, on_text=on_text,
                        **{**self.generation_options(), **options})

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh grammar state (runtime_metal/constraint.py) over this model's vocabulary,
        for one generation."""
        vocab = constraint_vocab(self.tokenizer, self.manifest.model.vocab_size, self.eos_ids)
        return TokenConstraint(vocab, grammar)

    def session(self) -> CachedSession:
        """Generations that keep the KV cache between calls (a conversation)."""
        return CachedSession(self.engine, **self.generation_options())

    def _text_tokenizer(self) -> Any | None:
        """The tokenizer where the artifact has one or it was loaded already, else None."""
        return self.tokenizer if self.has_tokenizer or "tokenizer" in self.__dict__ else None


def open_model(out_dir: str | Path, engine: str = "auto", *, defer_engine: bool = False,
               **engine_options: Any) -> LoadedModel:
    """Open the artifact in `out_dir` with engine `engine` ("auto": MLX on a GPU, onnxruntime
    otherwise; "mlx"; "onnxruntime"); engine_options go to the engine (accuracy_level,
    threads, profiler, ...). defer_engine: build the engine on first use of `.engine`."""
    model = LoadedModel(out_dir, engine, engine_options)
    if not defer_engine:
        model.engine  # noqa: B018 - opening is the point
    return model
