"""fuselm.json's schema: each field's type and allowed values, checked when an artifact is read,
and the manifest's shapes checked against model.onnx's inputs when an engine opens it.

A small hand schema, not pydantic, because:
- the field types are already written once, as the annotations of artifact.py's dataclasses;
  reading them here keeps that single definition (pydantic would want its own models, or a
  TypeAdapter over the same dataclasses, and still only the types);
- what the runtime needs beyond types is values and agreement (positive counts, heads divisible
  by KV heads, a known dtype, EOS ids inside the vocabulary, KV shapes equal to the graph's
  past_key_values inputs), which is hand-written code under either;
- errors must be one line naming the field, the value and what is allowed (pydantic's are
  multi-line reports that would be re-worded anyway);
- it runs on every load: this costs microseconds and no import (importing pydantic and building
  a schema costs tens of milliseconds; the convert-side config schema, export/config_check.py, uses
  pydantic because there the input is foreign JSON with many optional fields).
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from fuselm.runtime_metal.artifact_paths import name_problem
from fuselm.runtime_metal.graph_io import PAST
from fuselm.runtime_metal.manifest_types import (
    FORMAT,
    FORMAT_VERSION,
    ArtifactError,
    Manifest,
    ModelInfo,
    RopeInfo,
)

DTYPES = ("float32", "float16", "bfloat16")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# Counts that must be >= 1; everything else numeric is only type-checked (or checked below).
_POSITIVE = {"parameters", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
             "head_dim", "intermediate_size", "vocab_size", "context_length", "sliding_window",
             "rotary_dim"}
_POSITIVE_FLOAT = {"rms_norm_eps", "theta", "attention_scale"}


def _fail(path: Path, where: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ArtifactError(f"{path}: field {where} is {value!r} ({type(value).__name__}); "
                        f"allowed: {allowed}. Re-run `fuselm convert` to rewrite it")


def _type_name(tp: Any) -> str:
    if isinstance(tp, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is not None:
        return {dict: "an object", list: "a list"}.get(origin, str(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        tp, str(tp))


def _is(value: Any, tp: Any) -> bool:
    """JSON value `value` has annotation type `tp` (int, float, str, bool, X | None, dict, list)."""
    if isinstance(tp, types.UnionType):
        return any(_is(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    origin = typing.get_origin(tp) or tp
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
            value)
    if origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_is(v, item) for v in value)
    return isinstance(value, origin)


def _section(raw: Mapping[str, Any], name: str, cls: type, path: Path) -> None:
    section = raw.get(name)
    if not isinstance(section, dict):
        _fail(path, name, section, "an object")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in section:
        if key not in known:
            _fail(path, f"{name}.{key}", section[key],
                  f"no such field ({', '.join(sorted(known))})")
    for f in fields(cls):
        where = f"{name}.{f.name}"
        if f.name not in section:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ArtifactError(f"{path}: field {where} is missing; re-run `fuselm convert`")
            continue
        value = section[f.name]
        if not _is(value, hints[f.name]):
            _fail(path, where, value, _type_name(hints[f.name]))
        if isinstance(value, int) and f.name in _POSITIVE and value < 1:  # (rope.parameters: dict)
            _fail(path, where, value, "an integer >= 1")
        if f.name in _POSITIVE_FLOAT and value <= 0:
            _fail(path, where, value, "a number > 0")


def _token_id(path: Path, where: str, value: Any, vocab: int, many: bool) -> None:
    ids = value if many and isinstance(value, list) else [value]
    allowed = (f"null, an integer in [0, {vocab}) or a list of them" if many
               else f"null or an integer in [0, {vocab})")
    for v in ids:
        if v is None and not (many and isinstance(value, list)):
            continue
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab:
            _fail(path, where, value, allowed)


def check(raw: Any, path: Path) -> None:
    """Raise ArtifactError naming the first field of fuselm.json that breaks the schema."""
    if not isinstance(raw, dict):
        _fail(path, "(top level)", raw, "a JSON object")
    if raw.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a fuselm manifest (format={raw.get('format')!r})")
    version = raw.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        _fail(path, "format_version", version, f"the integer {FORMAT_VERSION}")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format_version {version}; this fuselm reads version {FORMAT_VERSION}. "
            "Re-convert the model with this fuselm.")
    _section(raw, "model", ModelInfo, path)
    _section(raw, "rope", RopeInfo, path)
    m = raw["model"]
    if m["num_heads"] % m["num_kv_heads"]:
        _fail(path, "model.num_kv_heads", m["num_kv_heads"],
              f"a divisor of model.num_heads ({m['num_heads']})")
    if raw["rope"]["rotary_dim"] > m["head_dim"]:
        _fail(path, "rope.rotary_dim", raw["rope"]["rotary_dim"],
              f"at most model.head_dim ({m['head_dim']})")
    if raw.get("dtype") not in DTYPES:
        _fail(path, "dtype", raw.get("dtype"), " or ".join(DTYPES))
    hints = typing.get_type_hints(Manifest)
    for key in ("special_tokens", "source", "versions", "quantization", "passes", "steps",
                "files", "integrity"):
        if key in raw and not _is(raw[key], hints[key]):
            _fail(path, key, raw[key], _type_name(hints[key]))
    special = raw.get("special_tokens") or {}
    for key in ("bos", "pad"):
        _token_id(path, f"special_tokens.{key}", special.get(key), m["vocab_size"], many=False)
    _token_id(path, "special_tokens.eos", special.get("eos"), m["vocab_size"], many=True)
    _check_file_names(raw.get("files") or {}, path)
    _check_integrity(raw.get("integrity"), path)


_INSIDE = "a relative path inside the artifact folder (no absolute path, no '..')"


def _check_file_names(files: dict[str, Any], path: Path) -> None:
    """`files`' names are paths fuselm may open: none may point outside the artifact."""
    for key, value in files.items():
        for name in value if isinstance(value, list) else [value]:
            if isinstance(name, str) and name_problem(name):
                _fail(path, f"files.{key}", name, _INSIDE)


def _check_integrity(section: dict[str, Any] | None, path: Path) -> None:
    if section is None:
        return
    files = section.get("files", {})
    if not isinstance(files, dict):
        _fail(path, "integrity.files", files, "an object of file records")
    for name, rec in files.items():
        where = f"integrity.files.{name}"
        if name_problem(name):
            _fail(path, "integrity.files", name, _INSIDE)
        if not isinstance(rec, dict):
            _fail(path, where, rec, 'an object {"size": ..., "sha256": ...}')
        size, digest = rec.get("size"), rec.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            _fail(path, f"{where}.size", size, "an integer >= 0")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            _fail(path, f"{where}.sha256", digest, "64 lowercase hex digits")
    tensors = section.get("tensors", {})
    if not isinstance(tensors, dict) or not all(isinstance(v, dict) for v in tensors.values()):
        _fail(path, "integrity.tensors", tensors, "an object of per-file tensor digests")
    for name in tensors:
        if name_problem(name):
            _fail(path, "integrity.tensors", name, _INSIDE)


Shape = Sequence[int | str | None]


def check_graph_io(manifest: Manifest, inputs: Mapping[str, Shape], model_file: Path,
                   past_dtype: str | None = None,
                   outputs: Mapping[str, Shape] | None = None) -> None:
    """The manifest's layers, KV heads, head_dim and dtype must match model.onnx's
    past_key_values inputs (`past_dtype`: their element type, float32 | float16 | bfloat16,
    if known), and its vocab_size the graph's logits (`outputs`, when given): every token id
    the runtime accepts is checked against vocab_size, so a larger one would reach the
    embedding Gather."""
    m = manifest.model
    logits = (outputs or {}).get("logits") or []
    vocab = logits[-1] if logits else None
    if isinstance(vocab, int) and vocab > 0 and vocab != m.vocab_size:
        raise ArtifactError(
            f"fuselm.json says model.vocab_size = {m.vocab_size} but {model_file}'s logits have "
            f"{vocab} entries; the two files come from different conversions: re-run "
            "`fuselm convert`")
    if past_dtype in DTYPES and past_dtype != manifest.dtype:
        raise ArtifactError(
            f"fuselm.json says dtype = {manifest.dtype} but {model_file}'s past_key_values "
            f"inputs are {past_dtype}; the two files come from different conversions: re-run "
            "`fuselm convert`")
    layers = {int(g.group(1)) for n in inputs if (g := PAST.match(n))}
    if layers and len(layers) != m.num_layers:
        raise ArtifactError(
            f"fuselm.json says model.num_layers = {m.num_layers} but {model_file} has "
            f"{len(layers)} layers of past_key_values inputs; the two files come from different "
            "conversions: re-run `fuselm convert`")
    for name, shape in inputs.items():
        if not PAST.match(name) or len(shape) != 4:
            continue
        for axis, field_name, want in ((1, "num_kv_heads", m.num_kv_heads),
                                       (3, "head_dim", m.head_dim)):
            got = shape[axis]
            if isinstance(got, int) and got > 0 and got != want:
                raise ArtifactError(
                    f"fuselm.json says model.{field_name} = {want} but {model_file} input "
                    f"{name} has {got} on that axis (shape {list(shape)}); the two files come "
                    "from different conversions: re-run `fuselm convert`")


def onnx_past_dtype(model: Any) -> str | None:
    """float32 | float16 | bfloat16: the element type of an onnx.ModelProto's past_key_values
    inputs."""
    names = {1: "float32", 10: "float16", 16: "bfloat16"}
    return next((names.get(vi.type.tensor_type.elem_type) for vi in model.graph.input
                 if PAST.match(vi.name)), None)


def ort_past_dtype(inputs: Sequence[Any]) -> str | None:
    """The same, from onnxruntime's NodeArg list (types written 'tensor(float16)')."""
    names = {"tensor(float)": "float32", "tensor(float16)": "float16",
             "tensor(bfloat16)": "bfloat16"}
    return next((names.get(i.type) for i in inputs if PAST.match(i.name)), None)


def onnx_inputs(model: Any) -> dict[str, list[int | str | None]]:
    """name -> shape (ints, symbolic names, or None) of an onnx.ModelProto's graph inputs."""
    return _shapes(model.graph.input)


def onnx_outputs(model: Any) -> dict[str, list[int | str | None]]:
    """The same for its graph outputs."""
    return _shapes(model.graph.output)


def _shapes(values: Any) -> dict[str, list[int | str | None]]:
    return {
        vi.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                  for d in vi.type.tensor_type.shape.dim]
        for vi in values
    }
