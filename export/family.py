"""What one architecture module owns, and the registry it joins (a leaf: it imports no family).

A family is a small class registered under its HF class names (`architectures[0]` of
config.json), like llama.cpp's `@ModelBase.register(...)`:

    @register("MistralForCausalLM")
    class Mistral(Family):
        model_type = "mistral"
        def windows(self, hf, layers): ...

The base class is the plain Llama decoder; a family overrides only its hooks:
`configure` (config quirks → DecoderSpec fields), `windows` (which layers slide),
`ropes` (per-layer RoPE, None for a layer without one), `layer_names` / `sources` (where each
parameter lives in the checkpoint and how it is laid out). Shared code (config.py, decoder.py,
registry.py) knows no family by name; export/families/ imports every module in it, so adding a
family is one file there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from fuselm.export.config import DecoderSpec, RopeSpec, rope_spec
from fuselm.export.errors import ExportError


@dataclass(frozen=True)
class Source:
    """Where a parameter's values come from in the HF checkpoint, and how they are laid out."""

    hf_name: str
    transpose: bool = False  # HF Linear stores [N, K]; MatMul wants [K, N]
    rows: tuple[int, int] | None = None  # a slice [start, stop) of dim 0 (fused checkpoints)
    offset: float = 0.0  # added to every value (a norm stored as w but applied as 1 + w)


# The decoder's parameter names (export/decoder.py) → the Llama checkpoint's, per layer.
LLAMA_LAYER_NAMES: dict[str, str] = {
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class Family:
    """The Llama decoder; subclasses override the hooks their architecture needs."""

    architectures: ClassVar[tuple[str, ...]] = ()
    model_type: ClassVar[str] = ""  # transformers' model_type (tests build configs from it)
    layer_names: ClassVar[dict[str, str]] = LLAMA_LAYER_NAMES
    norm_offset: ClassVar[float] = 0.0  # 1.0 where norms are applied as (1 + w)
    # config fields the built-in test models of this family set unless told otherwise
    # (converter/models/builtin.py)
    test_defaults: ClassVar[dict[str, Any]] = {}
    demo: ClassVar[bool] = False  # the family the built-in demo model is, by default
    # GGUF input (export/gguf/config.py): the `general.architecture` llama.cpp writes this
    # family as (None: not read from GGUF), the word in `general.name` that tells this family
    # apart from others written under the same architecture, whether llama.cpp permuted
    # the q/k rows (its Llama convention), and the llama.cpp names of layer tensors that this
    # family's checkpoint names differently from Llama's table (export/gguf/source.py)
    gguf_architecture: ClassVar[str | None] = None
    gguf_name_marker: ClassVar[str] = ""
    gguf_permuted_qk: ClassVar[bool] = False
    gguf_layer_names: ClassVar[dict[str, str]] = {}

    def gguf_config(self, config: dict[str, Any], tensors: Any, window: int | None,
                    keys: Any) -> None:
        """Config fields this family's GGUF file implies (set into `config`): biases from
        which tensors exist (`tensors`: the file's tensor names), the sliding window the file
        declares, and any `{arch}.*` metadata the family reads (`keys`: export/gguf/config.py
        `ArchKeys`, type-checked reads). The base family has no biases and refuses a window."""
        if window:
            raise ExportError(f"a sliding window on a {self.model_type} model is not supported")

    def activation(self, hf: Any) -> str:
        act = getattr(hf, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ExportError(
                f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        return ACTIVATIONS[act]

    def configure(self, hf: Any, spec: DecoderSpec) -> DecoderSpec:
        """Config quirks: return `spec` with this family's fields set."""
        return spec

    def windows(self, hf: Any, layers: int) -> list[int | None]:
        """Per-layer sliding windows, as HF builds its masks (5.x `layer_types`)."""
        window = getattr(hf, "sliding_window", None)
        types = getattr(hf, "layer_types", None)
        if not types:
            return [None] * layers
        if any(t not in ("full_attention", "sliding_attention") for t in types):
            raise ExportError(f"unsupported layer_types {sorted(set(types))}")
        if "sliding_attention" in types and not window:
            raise ExportError("layer_types has sliding_attention but sliding_window is not set")
        return [int(window) if t == "sliding_attention" else None for t in types]

    def ropes(self, hf: Any, head_dim: int, layers: int) -> list[RopeSpec | None]:
        """Per-layer RoPE (None: the layer has none)."""
        return [rope_spec(hf, head_dim)] * layers

    def sources(self, spec: DecoderSpec, params: list[str]) -> dict[str, Source]:
        """Decoder parameter name → where its values live in the checkpoint."""
        out: dict[str, Source] = {"embed": Source("model.embed_tokens.weight")}
        for name in params:
            if name.startswith("layers."):
                _, i, local, *rest = name.split(".")
                out[name] = self.layer_source(spec, int(i), local, rest[0] if rest else "")
        out["norm"] = Source("model.norm.weight", offset=self.norm_offset)
        if not spec.tie_word_embeddings:
            out["lm_head"] = Source("lm_head.weight", transpose=True)
        return out

    def layer_source(self, spec: DecoderSpec, i: int, local: str, kind: str) -> Source:
        """One layer parameter: `kind` is "weight"/"bias" for projections, "" for norms."""
        hf = f"model.layers.{i}.{self.layer_names[local]}"
        if kind == "weight":
            return Source(f"{hf}.weight", transpose=True)
        if kind == "bias":
            return Source(f"{hf}.bias")
        return Source(f"{hf}.weight", offset=self.norm_offset)


ARCHITECTURES: dict[str, Family] = {}


def register(*names: str) -> Callable[[type[Family]], type[Family]]:
    """Class decorator: the family reads checkpoints whose config names any of `names`."""

    def wrap(cls: type[Family]) -> type[Family]:
        cls.architectures = tuple(names)
        instance = cls()
        for name in names:
            ARCHITECTURES[name] = instance
        return cls

    return wrap
