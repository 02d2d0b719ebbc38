"""The convert pipeline: HF model dir → export → passes → (quantize) → artifact in OUT_DIR.

Everything is written into a temporary sibling of OUT_DIR and swapped into place at the end, so
a failure never leaves a half-written OUT_DIR behind (converter/out_dir.py: the swap, the
refused -o paths, and the repair of what a killed conversion left).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import onnx

from fuselm.converter import out_dir as out_dir_safety
from fuselm.converter.errors import UserError
from fuselm.export import heap
from fuselm.export.config import DecoderSpec
from fuselm.export.gguf.file import is_gguf
from fuselm.export.tokenizer_check import check_tokenizer
from fuselm.input_files import check_regular
from fuselm.passes import ops
from fuselm.passes.manager import select
from fuselm.passes.quant.options import FLAGS as QUANT_FLAGS
from fuselm.passes.quant.options import SOURCE_DEFAULT, QuantOptions, quant_options
from fuselm.passes.quant.quantize import SPILL_FILE
from fuselm.runtime_metal import artifact, integrity

Progress = Callable[[str, int, int], None]


@dataclass
class ConvertOptions:
    dtype: str | None = None  # None/"auto": the checkpoint's (bf16 → float16)
    optimize: bool = True
    passes: list[str] | None = None  # None = the whole pipeline
    quant: QuantOptions | None = None  # None: float weights (passes/quant/options.py)
    keep_intermediate: bool = False
    allow_nonfinite: bool = False  # NaN/Inf weights converted (and recorded) instead of refused
    adapter: Path | None = None  # a PEFT LoRA folder merged into the weights (export/lora.py)
    # quant None and a checkpoint that comes quantized (a GGUF in export/gguf/blocks.py's
    # EXACT_TYPES): keep its blocks (passes/quant/options.py SOURCE_DEFAULT); False
    # (`--quant none`): float weights
    source_quant: bool = True

    def __post_init__(self) -> None:
        if self.quant is not None and not isinstance(self.quant, QuantOptions):
            raise TypeError(f"ConvertOptions.quant is a QuantOptions or None, not "
                            f"{self.quant!r}; ConvertOptions.from_flags(quant='q4', ...) "
                            "builds one from the flags")
        if self.adapter is not None:
            self.adapter = Path(self.adapter)
        if self.quant is not None and not self.optimize:  # else the flag would be dropped
            name = "mixed" if self.quant.mixed else f"q{self.quant.bits}"
            raise UserError(f"--quant {name} quantizes in the graph passes, which --no-optimize "
                            "skips; give one of them")
        if self.keep_intermediate and not self.optimize:
            raise UserError("--keep-intermediate keeps raw.onnx, the graph before the passes; "
                            "with --no-optimize model.onnx is that graph. Give one of them")

    @classmethod
    def from_flags(cls, **options: Any) -> ConvertOptions:
        """The options as the Python API spells them: this class's fields, with `quant` ("q4"
        | "none" | None, or a QuantOptions) and the quantization flags of
        passes/quant/options.py's `quant_options` (block_size, symmetric, quant_lm_head, ...)
        beside them. Unknown names and bad values are refused, naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known - set(QUANT_FLAGS))
        if unknown:
            raise UserError(f"unknown convert option(s) {', '.join(unknown)}; "
                            f"choose from {', '.join(sorted(known | set(QUANT_FLAGS)))}")
        flags = {k: options.pop(k) for k in QUANT_FLAGS if k in options and k != "quant"}
        quant = options.pop("quant", None)
        if isinstance(quant, str) and quant.lower() == "none":  # asked for: float weights
            options.setdefault("source_quant", False)
        if not isinstance(quant, QuantOptions):
            quant = quant_options(quant, **flags)
        elif flags:
            raise UserError(f"give {', '.join(sorted(flags))} inside quant=QuantOptions(...), "
                            "or quant='q4' with them beside it")
        return cls(quant=quant, **options)


@dataclass
class ConvertResult:
    out_dir: Path
    manifest: artifact.Manifest
    seconds: dict[str, float] = field(default_factory=dict)
    report: Any = None  # the pass manager's report, when passes ran


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("fuselm", "torch", "onnx", "onnxruntime", "onnxscript", "transformers", "mlx"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def _side_files(model_dir: Path) -> list[str]:
    """The tokenizer and generation files of the checkpoint, copied into the artifact."""
    return [name for name in (*artifact.TOKENIZER_FILES, artifact.GENERATION_CONFIG)
            if (model_dir / name).is_file()]


def _artifact_files(model_dir: Path, opts: ConvertOptions) -> list[str]:
    """Every file the conversion writes into OUT_DIR (fuselm.json records all but itself)."""
    kept = list(artifact.INTERMEDIATE_FILES) if opts.keep_intermediate and opts.optimize else []
    return [artifact.MODEL_FILE, artifact.DATA_FILE, *_side_files(model_dir), *kept]


def _copy_side_files(model_dir: Path, out: Path) -> list[str]:
    copied = _side_files(model_dir)
    for name in copied:
        shutil.copy2(model_dir / name, out / name)
    return copied


def _manifest(
    spec: DecoderSpec, dtype: str, model_dir: Path, ckpt_dtype: str, opts: ConvertOptions
) -> artifact.Manifest:
    r = spec.rope
    return artifact.Manifest(
        # ModelInfo's fields are a subset of DecoderSpec's, under the same names
        model=artifact.ModelInfo(
            **{f.name: getattr(spec, f.name) for f in fields(artifact.ModelInfo)}
        ),
        rope=artifact.RopeInfo(
            type=r.type,
            theta=r.theta,
            rotary_dim=r.rotary_dim,
            attention_scale=r.attention_scale,
            parameters=r.parameters,
        ),
        dtype=dtype,
        special_tokens={
            "bos": spec.bos_token_id,
            "eos": spec.eos_token_ids,
            "pad": spec.pad_token_id,
        },
        source={"path": str(model_dir.resolve()), "checkpoint_dtype": ckpt_dtype},
        versions=_versions(),
        files={"model": artifact.MODEL_FILE, "data": artifact.DATA_FILE},
    )


def _run_passes(raw: Path, final: Path, opts: ConvertOptions, calibration: Any = None,
                exported: Any = None) -> Any:
    """Run the pass pipeline (and quantization) on raw.onnx, write the fused model.

    The weights stay in raw.onnx.data — or in the checkpoint, when `exported` carries the
    model in memory: the passes see references, quantization reads one weight at a time, and
    the writer streams the final data file (passes/weights.py).
    """
    from fuselm.passes.manager import run_pipeline

    sources = None
    if exported is not None and exported.model is not None:
        model, sources = exported.model, exported.sources
    else:
        model = onnx.load(str(raw), load_external_data=False)
    quantize = None
    if opts.quant is not None:
        from fuselm.passes.quant.quantize import QuantizeQ4

        given = None if exported is None else exported.given
        quantize = QuantizeQ4(opts.quant, calibration, spill_dir=raw.parent, given=given)
    deferred: dict[str, Any] = {}
    model, report = run_pipeline(
        model, passes=opts.passes, quantize=quantize, base_dir=raw.parent, deferred=deferred,
        sources=sources,
    )
    save_model(model, final, base_dir=raw.parent, deferred=deferred)
    (raw.parent / SPILL_FILE).unlink(missing_ok=True)  # the quantized tensors, now copied
    return report


def _quantization_record(report: Any) -> dict[str, Any] | None:
    """The quantize pass's record (bits, block, scheme, tensors) for fuselm.json."""
    for entry in report.entries:
        if "quantization" in entry.extra:
            return dict(entry.extra["quantization"])
    return None


def save_model(
    model: onnx.ModelProto,
    path: Path,
    base_dir: Path | None = None,
    deferred: dict[str, Any] | None = None,
) -> None:
    """Save with every weight in `<name>.data` beside it (one file, 64-byte aligned), streamed
    from `base_dir`'s external data and `deferred` values (passes/writer.py)."""
    from fuselm.passes.writer import write_model

    ops.attach_functions(model)
    write_model(model, path, base_dir=base_dir, deferred=deferred)


def check_model(path: Path) -> None:
    onnx.checker.check_model(str(path), full_check=False)


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    options: ConvertOptions | None = None,
    progress: Progress | None = None,
    checkpoint: Any = None,
    source: dict[str, Any] | None = None,
    exporter: Callable[..., Any] | None = None,
    spec: DecoderSpec | None = None,
) -> ConvertResult:
    """`checkpoint`: the weights, when not model_dir's safetensors (a .gguf model_dir is read
    through converter/gguf_input.py); `source`: extra facts for fuselm.json's `source`;
    `exporter`: what writes raw.onnx, export_model's signature (default for an HF directory:
    converter/exporter_choice.py's choice), `spec` the model's, when known."""
    with out_dir_safety.terminate_as_exit():
        return _convert(model_dir, out_dir, options, progress, checkpoint, source, exporter, spec)


def _convert(
    model_dir: str | Path,
    out_dir: str | Path,
    options: ConvertOptions | None,
    progress: Progress | None,
    checkpoint: Any,
    source: dict[str, Any] | None,
    exporter: Callable[..., Any] | None,
    spec: DecoderSpec | None,
) -> ConvertResult:
    if checkpoint is None and is_gguf(model_dir):
        from fuselm.converter.gguf_input import staged_gguf

        if options is not None and options.adapter is not None:
            raise UserError(f"--adapter merges into an HF model folder's float weights, and "
                            f"{model_dir} is a GGUF file; convert the adapter's HF base model")
        with staged_gguf(model_dir, out_dir) as staged:
            opts = options or ConvertOptions()
            if (opts.quant is None and opts.source_quant and opts.optimize
                    and staged.checkpoint.quantized):  # the passes keep the blocks
                options = replace(opts, quant=SOURCE_DEFAULT)
            return _convert(staged.meta, out_dir, options, progress, staged.checkpoint,
                            staged.source, staged.exporter, staged.spec)
    opts = options or ConvertOptions()
    src, out = Path(model_dir), Path(out_dir)
    hf_dir = checkpoint is None
    t0 = time.perf_counter()
    # Options are validated when made; config and architecture before touching OUT_DIR.
    out_dir_safety.check_paths(src, out)
    for name in (*artifact.TOKENIZER_FILES, artifact.GENERATION_CONFIG):
        check_regular(src / name)  # a FIFO or folder under a side file's name: not skipped
    if opts.optimize:
        select(opts.passes)  # unknown --passes names: refused before the export, not after
    if spec is None:
        from fuselm.export.config import read_raw_config
        from fuselm.export.open_checkpoint import open_checkpoint, source_record
        from fuselm.export.registry import decoder_spec
        from fuselm.export.tensor_match import check_layer_count

        # the config's layer count against the tensor table, before transformers' config class
        # and the exporter build that many layers (export/tensor_match.py)
        layers = read_raw_config(src)["num_hidden_layers"]
        if checkpoint is None:
            checkpoint = open_checkpoint(src, opts.adapter, requantize=(
                opts.quant is not None or not opts.source_quant))
            if (opts.quant is None and opts.source_quant and opts.optimize
                    and getattr(checkpoint, "quantized", 0)):
                # AWQ / GPTQ: the blocks kept (a packed LM head's too); float tables stay float
                head = "lm_head.weight" in checkpoint.layers
                opts = replace(opts, quant=replace(SOURCE_DEFAULT, lm_head=head,
                                                   embeddings=False))
        check_layer_count(checkpoint.tensors, src, layers)
        spec = decoder_spec(src)
        source = {**source_record(checkpoint, spec), **(source or {})}
    check_tokenizer(src, spec.vocab_size)
    calib = None
    if opts.quant is not None and opts.quant.calibration:
        from fuselm.converter.calibration_input import load_calibration

        calib = load_calibration(src, opts.quant.calibration)
    elif opts.quant is not None and opts.quant.calibrates:
        from fuselm.converter.calibration_input import builtin_calibration

        calib = builtin_calibration(src, spec)
    if exporter is None and hf_dir:
        from fuselm.converter.exporter_choice import exporter_for

        exporter, label = exporter_for(spec)
        source = {"exporter": label, **(source or {})}
    files = _artifact_files(src, opts)
    build = out_dir_safety.prepare(out, [*files, artifact.MANIFEST])
    tmp = build.tmp
    seconds: dict[str, float] = {}
    try:
        raw = tmp / ("raw.onnx" if opts.optimize else artifact.MODEL_FILE)
        # No raw.onnx.data unless it is kept or records non-finite weights: the passes read
        # the weights from the checkpoint (16 GB less written and read back for an 8B model).
        in_memory = opts.optimize and not opts.keep_intermediate and not opts.allow_nonfinite
        if exporter is None:
            from fuselm.export.onnx_export import export_model as exporter
        exported = exporter(
            src, raw, opts.dtype, progress, opts.allow_nonfinite, checkpoint=checkpoint,
            in_memory=in_memory,
        )
        if exported.nonfinite and opts.quant:
            raise UserError(
                f"tensor {exported.nonfinite[0]} holds NaN/Inf values, which 4-bit blocks cannot "
                "represent; convert it without --quant, or fix the checkpoint"
            )
        seconds["export"] = time.perf_counter() - t0
        heap.release()  # the export's temporaries, before the passes start
        steps = ["export"]
        report = None
        if opts.optimize:
            t1 = time.perf_counter()
            if progress:
                progress("passes", 0, 1)
            report = _run_passes(raw, tmp / artifact.MODEL_FILE, opts, calib, exported)
            if progress:
                progress("passes", 1, 1)
            exported.model = exported.sources = None  # type: ignore[assignment]
            seconds["passes"] = time.perf_counter() - t1
            steps.append("passes")
            if opts.quant is not None:
                steps.append("quantize")
            if not opts.keep_intermediate:
                raw.unlink(missing_ok=True)
                raw.with_name(raw.name + ".data").unlink(missing_ok=True)
        check_model(tmp / artifact.MODEL_FILE)
        steps.append("check")
        manifest = _manifest(exported.spec, exported.dtype, src, exported.checkpoint_dtype, opts)
        manifest.steps = steps
        if opts.allow_nonfinite:
            manifest.source["nonfinite_tensors"] = exported.nonfinite
        if report is not None:
            manifest.passes = report.to_dict()
            manifest.quantization = _quantization_record(report)
        manifest.files["tokenizer"] = _copy_side_files(src, tmp)
        manifest.source.update(source or {})
        t2 = time.perf_counter()
        manifest.integrity = integrity.record(tmp, files)
        seconds["hash"] = time.perf_counter() - t2
        manifest.source["converted"] = datetime.now(UTC).isoformat(timespec="seconds")
        manifest.source["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
        artifact.write_manifest(tmp, manifest)
        out_dir_safety.swap_in(build)
    except OSError as e:
        if e.errno in out_dir_safety.NO_SPACE:
            raise out_dir_safety.no_space(e, out) from None
        raise
    finally:
        build.close()  # the temp folder (if the swap did not take it) and the lock
    seconds["total"] = time.perf_counter() - t0
    return ConvertResult(out_dir=out, manifest=manifest, seconds=seconds, report=report)
