"""HF checkpoint → raw ONNX (opset 23 + fuselm), weights streamed straight to external data.

The clean decoder is traced on the meta device, so tracing costs the same for 1M or 1B
parameters; each weight is then read from the checkpoint (plain reads), laid out [K, N],
cast, and appended to `<model>.data` one tensor at a time. Peak memory ≈ the largest tensor.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto

from fuselm.export import heap
from fuselm.export.config import DecoderSpec
from fuselm.export.decoder import Decoder
from fuselm.export.errors import ExportError
from fuselm.export.export_result import ExportResult, given_lookup
from fuselm.export.registry import decoder_spec
from fuselm.export.safetensors.checkpoint import Checkpoint
from fuselm.export.tensor_match import check_layer_count, check_tensor_names
from fuselm.export.torch_ops import TRANSLATIONS
from fuselm.export.weight_screen import WeightScreen
from fuselm.passes import ops

if TYPE_CHECKING:
    from fuselm.export.gguf.source import GGUFCheckpoint

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ONNX_DTYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
                torch.bfloat16: TensorProto.BFLOAT16}
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16,
                 torch.bfloat16: ml_dtypes.bfloat16}
_ALIGN = 64  # bytes; keeps every tensor aligned for memory-mapped readers
SLAB_BYTES = 32 << 20  # bytes of rows cast and written at a time (see _write_cast)
_INLINE = 1024  # values: smaller weights are stored in the model itself (computed_weights)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def resolve_dtype(requested: str | None, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The graph dtype: as asked, else the checkpoint's (bf16 → float16, which runtimes run)."""
    if requested in (None, "auto"):
        return (
            torch.float16 if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.float32
        )
    if requested not in DTYPES:
        raise ExportError(f"--dtype {requested} is not supported; choose float32, float16 "
                          "or bfloat16")
    return DTYPES[requested]


def _trace(spec: DecoderSpec, dtype: torch.dtype) -> tuple[onnx.ModelProto, Decoder]:
    with torch.device("meta"):
        module = Decoder(spec, dtype).eval()
        b, s, past = 2, 5, 3  # > 1 so that torch.export does not specialize them
        ids = torch.zeros(b, s, dtype=torch.int64)
        mask = torch.ones(b, past + s, dtype=torch.int64)
        pos = torch.zeros(b, s, dtype=torch.int64)
        kv = [
            torch.zeros(b, spec.num_kv_heads, past, spec.head_dim, dtype=dtype)
            for _ in range(2 * spec.num_layers)
        ]
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    total, past_dim = torch.export.Dim("total"), torch.export.Dim("past")
    dynamic = (
        {0: batch, 1: seq},
        {0: batch, 1: total},
        {0: batch, 1: seq},
        [{0: batch, 2: past_dim}] * (2 * spec.num_layers),
    )
    inputs, outputs = io_names(spec.num_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo")]
        levels = [lg.level for lg in quiet]
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        try:
            program = torch.onnx.export(
                module,
                (ids, mask, pos, kv),
                dynamo=True,
                opset_version=ops.ONNX_OPSET,
                custom_translation_table=TRANSLATIONS,
                dynamic_shapes=dynamic,
                input_names=inputs,
                output_names=outputs,
                optimize=False,  # its passes read initializer values, which live on meta
                verbose=False,
            )
        finally:
            for lg, level in zip(quiet, levels, strict=True):
                lg.setLevel(level)
    import onnx_ir as ir
    import onnxscript.optimizer

    graph = program.model.graph
    params = dict(module.named_parameters())
    # Weights become graph inputs while onnxscript's optimizer runs (it folds constants and
    # removes dead shape work, and must never read or fold the weights), then initializers
    # again, without values: write_weights fills them from the checkpoint.
    weights = [v for name, v in graph.initializers.items() if name in params]
    for value in weights:
        graph.initializers.pop(value.name)
        value.const_value = None
        graph.inputs.append(value)
    onnxscript.optimizer.optimize_ir(program.model)
    for value in weights:
        graph.inputs.remove(value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = ir.serde.serialize_model(program.model)
    _rename_dims(proto)
    _drop_unused_outputs(proto)
    return proto, module


def _drop_unused_outputs(model: onnx.ModelProto) -> None:
    """Remove trailing optional outputs nobody reads (Attention's qk_matmul_output)."""
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    for node in model.graph.node:
        if node.op_type == "Attention":
            while len(node.output) > 3 and node.output[-1] not in used:
                node.output.pop()


def _rename_dims(model: onnx.ModelProto) -> None:
    """Name the dynamic axes as optimum does: batch, seq, past, past + seq."""
    rename = {"batch": "batch", "seq": "seq", "past": "past", "total": "past + seq"}
    for vi in [*model.graph.input, *model.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param:
                d.dim_param = rename.get(d.dim_param, d.dim_param)
    for vi in model.graph.output:
        if vi.name.startswith("present."):
            dims = vi.type.tensor_type.shape.dim
            dims[2].dim_param = "past + seq"
        if vi.name == "logits":
            vi.type.tensor_type.shape.dim[1].dim_param = "seq"


def _check_weights(module: Decoder, ckpt: Checkpoint) -> None:
    params = dict(module.named_parameters())
    for name, src in module.weight_sources().items():
        info = ckpt.info(src.hf_name)
        want = tuple(params[name].shape)
        have = info.shape
        if src.rows is not None:
            rows = min(src.rows[1], have[0]) - src.rows[0] if have else 0
            have = (rows, *have[1:])
        have = have[::-1] if src.transpose else have
        if tuple(have) != want:
            raise ExportError(
                f"tensor {src.hf_name} has shape {list(info.shape)} but config.json implies "
                f"{list(want[::-1] if src.transpose else want)}; the checkpoint does not match "
                "its config"
            )


def _write_cast(f: BinaryIO, tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Write `tensor` cast to `dtype`, in C order, a slab of rows at a time; the byte count.

    Slabs keep the cast (and, for a transposed view, the re-layout) at ~SLAB_BYTES instead of
    a whole second copy of the tensor: an 8B model's 128256 x 4096 LM head is 1 GB in float16.
    """
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    row = max(1, tensor[0].numel() if len(tensor) else 1) * max(tensor.element_size(), 4)
    step = max(1, SLAB_BYTES // row)
    nbytes = 0
    for r in range(0, len(tensor), step):
        part = _numpy(tensor[r : r + step].to(dtype).contiguous())
        f.write(memoryview(part).cast("B"))  # no extra copy of the bytes
        nbytes += part.nbytes
    return nbytes


def _prepared(ckpt: Checkpoint, src: Any, screen: WeightScreen | None) -> torch.Tensor:
    """One parameter's values from the checkpoint as the graph lays them out (rows cut, offset
    added, [K, N] as a transposed view), screened, not yet cast."""
    tensor = ckpt.get(src.hf_name)
    if src.rows is not None:
        tensor = tensor[src.rows[0] : src.rows[1]]
    if screen is not None:
        # after the row slice: a fused checkpoint tensor (Phi-3's qkv_proj) is read once
        # per slice, and the slices cover it exactly once
        screen(src.hf_name, tensor)  # NaN/Inf and float16 overflow, named
    if src.offset:
        tensor = tensor.float() + src.offset
    if src.transpose:
        tensor = tensor.t()
    return tensor


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as NumPy shares them (bfloat16 as ml_dtypes', which torch does not
    hand to NumPy itself)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _cast_array(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """`tensor` cast to `dtype` as a NumPy array of the same shape, cast a slab of rows of its
    stored layout at a time (a transposed view comes back as the transpose of a C-order array:
    the consumers re-lay it out tile by tile, or not at all)."""
    transposed = tensor.dim() == 2 and not tensor.is_contiguous() and tensor.t().is_contiguous()
    base = tensor.t() if transposed else tensor.contiguous()
    if base.dim() < 2:
        return _numpy(base.to(dtype))
    arr = np.empty(tuple(base.shape), _NUMPY_DTYPES[dtype])  # huge pages (export/checkpoint)
    out = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) \
        if dtype == torch.bfloat16 else torch.from_numpy(arr)
    row = max(1, base[0].numel()) * max(base.element_size(), 4)
    step = max(1, SLAB_BYTES // row)
    for r in range(0, len(base), step):
        out[r : r + step] = base[r : r + step].to(dtype)
    return arr.T if transposed else arr


def computed_weights(
    model: onnx.ModelProto,
    module: Decoder,
    ckpt: Checkpoint,
    dtype: torch.dtype,
    screen: WeightScreen | None = None,
) -> dict[str, Callable[[], np.ndarray]]:
    """Every parameter as a data-less initializer of `model` and its values as a recipe that
    reads it from the checkpoint when asked (quantization, the final writer): no intermediate
    data file (an 8B model's would be 16 GB written and read back). Small tensors (≤ 1024
    values: shape inference reads those) are read now and stored inline."""
    sources = module.weight_sources()
    params = dict(module.named_parameters())
    existing = {t.name for t in model.graph.initializer}
    out: dict[str, Callable[[], np.ndarray]] = {}
    for name, src in sources.items():
        if name in existing:
            raise ExportError(f"internal: {name} already has a value")
        proto = TensorProto(name=name, data_type=_ONNX_DTYPES[dtype])
        proto.dims.extend(params[name].shape)

        def compute(src: Any = src) -> np.ndarray:
            return _cast_array(_prepared(ckpt, src, screen), dtype)

        if params[name].numel() <= _INLINE:
            proto.raw_data = np.ascontiguousarray(compute()).tobytes()
            # as the writer inlines a small external tensor: the same model bytes either way
            proto.data_location = TensorProto.DEFAULT
        else:
            out[name] = compute
        model.graph.initializer.append(proto)
    return out


def write_weights(
    model: onnx.ModelProto,
    module: Decoder,
    ckpt: Checkpoint,
    data_path: Path,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
    screen: WeightScreen | None = None,
) -> int:
    """Stream every parameter from the checkpoint into `data_path`; add external initializers."""
    sources = module.weight_sources()
    params = dict(module.named_parameters())
    existing = {t.name for t in model.graph.initializer}
    offset = 0
    with data_path.open("wb") as f:
        for i, (name, src) in enumerate(sources.items()):
            tensor = _prepared(ckpt, src, screen)
            pad = (-offset) % _ALIGN
            f.write(b"\0" * pad)
            offset += pad
            nbytes = _write_cast(f, tensor, dtype)
            del tensor
            if name in existing:
                raise ExportError(f"internal: {name} already has a value")
            proto = TensorProto(name=name, data_type=_ONNX_DTYPES[dtype])
            proto.dims.extend(params[name].shape)
            proto.data_location = TensorProto.EXTERNAL
            for key, value in (
                ("location", data_path.name),
                ("offset", str(offset)),
                ("length", str(nbytes)),
            ):
                entry = proto.external_data.add()
                entry.key, entry.value = key, value
            model.graph.initializer.append(proto)
            offset += nbytes
            if progress:
                progress(i + 1, len(sources))
    return offset


def export_model(
    model_dir: str | Path,
    onnx_path: str | Path,
    dtype: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    allow_nonfinite: bool = False,
    checkpoint: Checkpoint | GGUFCheckpoint | None = None,
    in_memory: bool = False,
) -> ExportResult:
    """Export `model_dir` to `onnx_path` (+ `onnx_path`.data). The caller owns atomicity.
    `checkpoint`: where the weights come from (default: the safetensors in `model_dir`).
    `in_memory`: write nothing; the result carries the model and recipes for its weights,
    read from the checkpoint when the passes or the writer need them (computed_weights);
    NaN/Inf weights are then refused when read (allow_nonfinite needs the file)."""
    t0 = time.perf_counter()
    spec = decoder_spec(model_dir)
    ckpt = checkpoint if checkpoint is not None else Checkpoint(model_dir)
    graph_dtype = resolve_dtype(dtype, ckpt.dtype)
    result = ExportResult(
        spec=spec,
        dtype=str(graph_dtype).removeprefix("torch."),
        checkpoint_dtype=str(ckpt.dtype).removeprefix("torch."),
    )
    check_layer_count(ckpt.tensors, ckpt.root, spec.num_layers)  # before building every layer
    with torch.device("meta"):
        probe = Decoder(spec, graph_dtype)
    expected = [s.hf_name for s in probe.weight_sources().values()]
    check_tensor_names(expected, ckpt.tensors, ckpt.root, spec.num_layers, spec.tie_word_embeddings)
    _check_weights(probe, ckpt)
    if progress:
        progress("trace", 0, 1)
    model, module = _trace(spec, graph_dtype)
    result.given = given_lookup(ckpt, module.weight_sources())  # initializer = parameter name
    heap.release()  # the trace's graphs are garbage now; the weights phase starts from here
    result.seconds["trace"] = time.perf_counter() - t0
    if progress:
        progress("trace", 1, 1)
    t1 = time.perf_counter()
    onnx_path = Path(onnx_path)
    data_path = onnx_path.with_name(onnx_path.name + ".data")
    screen = WeightScreen(graph_dtype, allow_nonfinite)
    if in_memory:
        if allow_nonfinite:
            raise ValueError("in_memory export cannot record non-finite weights")
        result.sources = computed_weights(model, module, ckpt, graph_dtype, screen)
        inits = {t.name: t for t in model.graph.initializer}
        result.weight_bytes = sum(int(np.prod(inits[n].dims)) for n in result.sources)
        result.weight_bytes *= torch.empty((), dtype=graph_dtype).element_size()
        result.seconds["weights"] = time.perf_counter() - t1
        model.producer_name = "fuselm"
        ops.attach_functions(model)
        result.model = model
        return result
    result.weight_bytes = write_weights(
        model,
        module,
        ckpt,
        data_path,
        graph_dtype,
        (lambda i, n: progress("weights", i, n)) if progress else None,
        screen,
    )
    result.nonfinite = screen.nonfinite
    result.seconds["weights"] = time.perf_counter() - t1
    model.producer_name = "fuselm"
    ops.attach_functions(model)
    onnx.save(model, str(onnx_path))
    return result
