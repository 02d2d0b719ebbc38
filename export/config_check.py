"""The schema of an HF config.json (and generation_config.json): checked before transformers
or the exporter reads a single value, so a bad value is one message naming the file, the field,
the value and what is allowed, never a traceback from deep inside transformers or numpy.

Why pydantic rather than hand-written checks: its strict mode already separates `64` from
`"64"`, `true` from `1` and a list from a string, validates nested objects (`rope_parameters`)
and lists (`eos_token_id: [2, 3]`), rejects NaN/Infinity, and reports *every* failing field
with its location and input. What this module adds is only the project's words: each field's
`description` is the "what is allowed" half of the message, so the schema and the error text
are one definition. Only fields fuselm reads are declared; every other key passes through.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fuselm.export.errors import ExportError
from fuselm.input_files import load_file

_MAX_DIM = 2**31 - 1  # ONNX and the runtimes index with int32 in places; no real model is near
_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

Count = Annotated[int, Field(ge=1, le=_MAX_DIM)]
Positive = Annotated[float, Field(gt=0)]
TokenId = Annotated[int, Field(ge=0, le=_MAX_DIM)]


def _field(description: str, **kwargs: Any) -> Any:
    return Field(description=description, **kwargs)


class RopeParameters(BaseModel):
    """`rope_parameters` (transformers 5.x) or `rope_scaling` (4.x): only what fuselm reads."""

    model_config = _STRICT
    rope_type: str | None = _field("a RoPE type name (string)", default=None)
    type: str | None = _field("a RoPE type name (string)", default=None)
    rope_theta: Positive | None = _field("a number > 0", default=None)
    factor: Positive | None = _field("a number > 0", default=None)
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] | None = _field(
        "a number in (0, 1]", default=None
    )
    original_max_position_embeddings: Count | None = _field("an integer >= 1", default=None)
    low_freq_factor: Positive | None = _field("a number > 0", default=None)
    high_freq_factor: Positive | None = _field("a number > 0", default=None)


class HFConfig(BaseModel):
    """The config.json fields the exporter uses, with what each may hold."""

    model_config = _STRICT
    architectures: Annotated[list[str], Field(min_length=1)] = _field(
        'a non-empty list of model class names, e.g. ["Qwen3ForCausalLM"]'
    )
    hidden_size: Count = _field("an integer >= 1")
    num_hidden_layers: Count = _field("an integer >= 1 (the number of decoder layers)")
    num_attention_heads: Count = _field("an integer >= 1")
    intermediate_size: Count = _field("an integer >= 1")
    vocab_size: Count = _field("an integer >= 1")
    num_key_value_heads: Count | None = _field(
        "an integer >= 1 that divides num_attention_heads, or null", default=None
    )
    head_dim: Count | None = _field("an integer >= 1, or null", default=None)
    max_position_embeddings: Count = _field("an integer >= 1 (the context length)", default=4096)
    rms_norm_eps: Positive = _field("a number > 0", default=1e-6)
    rope_theta: Positive | None = _field("a number > 0", default=None)
    rope_scaling: RopeParameters | None = _field("an object or null", default=None)
    rope_parameters: RopeParameters | None = _field("an object or null", default=None)
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] | None = _field(
        "a number in (0, 1]", default=None
    )
    tie_word_embeddings: bool = _field("true or false", default=False)
    attention_bias: bool = _field("true or false", default=False)
    mlp_bias: bool = _field("true or false", default=False)
    hidden_act: str = _field("an activation name (string)", default="silu")
    sliding_window: Count | None = _field("an integer >= 1, or null", default=None)
    layer_types: list[str] | None = _field(
        "a list of one string per layer (full_attention / sliding_attention), or null",
        default=None,
    )
    bos_token_id: TokenId | None = _field("a token id (integer >= 0 below vocab_size) or null",
                                          default=None)
    pad_token_id: TokenId | None = _field("a token id (integer >= 0 below vocab_size) or null",
                                          default=None)
    eos_token_id: TokenId | list[TokenId] | None = _field(
        "a token id (integer >= 0 below vocab_size), a list of them, or null", default=None
    )

    @model_validator(mode="after")
    def _consistent(self) -> HFConfig:
        heads, kv = self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {heads} "
                "and head_dim is not given; set head_dim or fix the head count"
            )
        if heads % kv:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
                "each key/value head must serve a whole group of query heads"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                f"{self.num_hidden_layers}; they must agree"
            )
        _check_ids(self, self.vocab_size)
        return self


class GenerationConfig(BaseModel):
    """generation_config.json: only the special ids fuselm copies into the artifact."""

    model_config = _STRICT
    bos_token_id: TokenId | None = HFConfig.model_fields["bos_token_id"]
    pad_token_id: TokenId | None = HFConfig.model_fields["pad_token_id"]
    eos_token_id: TokenId | list[TokenId] | None = HFConfig.model_fields["eos_token_id"]


def _check_ids(cfg: BaseModel, vocab: int) -> None:
    for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(cfg, name)
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i >= vocab:
                raise ValueError(
                    f"{name} {json.dumps(value)} is outside the vocabulary (vocab_size {vocab}); "
                    "a token id must be below vocab_size"
                )


def _rope_types_ok(cfg: HFConfig, rope_types: tuple[str, ...], where: Path) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, key)
        kind = params and (params.rope_type or params.type)
        if kind and kind not in rope_types:
            raise ExportError(
                f"{where}: {key}.rope_type is {json.dumps(kind)}; supported RoPE types: "
                f"{', '.join(rope_types)}"
            )


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, str]:
    """(dotted field name, its `description`) for an error location; union branch tags and
    list indices are skipped, nested models followed."""
    current: Any = model
    names: list[str] = []
    description = ""
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            continue
        info = fields[part]
        names.append(part)
        description = info.description or description
        nested = [a for a in getattr(info.annotation, "__args__", (info.annotation,))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        current = nested[0] if nested else None
    return ".".join(names), description


def _value_at(raw: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def _message(model: type[BaseModel], where: Path, errors: list[Any], raw: dict[str, Any]) -> str:
    missing = [_locate(model, tuple(e["loc"]))[0] for e in errors if e["type"] == "missing"]
    if missing:
        return f"{where} is missing required keys: {', '.join(missing)}"
    err = errors[0]
    if err["type"] == "value_error" and not err["loc"]:  # a cross-field rule: the whole text
        return f"{where}: {err['ctx']['error']}"
    field, description = _locate(model, tuple(err["loc"]))
    shown = json.dumps(_value_at(raw, field) if field else err.get("input"))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{where}: {field or '(top level)'} is {shown}; it must be {description or err['msg']}"


def _validate(model: type[BaseModel], raw: Any, where: Path) -> BaseModel:
    if not isinstance(raw, dict):
        raise ExportError(f"{where} must hold a JSON object, not a JSON {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        fields = {_locate(model, tuple(x["loc"]))[0] for x in errors}
        missing = any(x["type"] == "missing" for x in errors)
        more = f" ({len(fields) - 1} more field(s) are wrong too)" if len(fields) > 1 else ""
        more = "" if missing else more
        raise ExportError(_message(model, where, errors, raw) + more) from None


def check_config(raw: Any, where: Path, rope_types: tuple[str, ...]) -> None:
    """Raise ExportError naming the first bad field of a parsed config.json."""
    if isinstance(raw, dict) and isinstance(raw.get("architectures"), str):
        raise ExportError(
            f"{where}: architectures is {json.dumps(raw['architectures'])}, a string; it must be "
            f'a list of class names, e.g. [{json.dumps(raw["architectures"])}]'
        )
    cfg = _validate(HFConfig, raw, where)
    assert isinstance(cfg, HFConfig)
    _rope_types_ok(cfg, rope_types, where)
    gen = where.with_name("generation_config.json")
    if gen.is_file():
        try:
            gen_raw = load_file(gen)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and JSONTooDeep too
            raise ExportError(f"{gen} is not valid JSON ({e})") from None
        gcfg = _validate(GenerationConfig, gen_raw, gen)
        try:
            _check_ids(gcfg, cfg.vocab_size)
        except ValueError as e:
            raise ExportError(f"{gen}: {e}") from None
