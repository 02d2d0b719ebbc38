"""`fuselm optimize IN.onnx -o OUT.onnx`: run the pass pipeline on any decoder ONNX file.

A lower opset is upgraded to 23 first (the fused ops are opset-23 ops). The report goes to
stderr as a table, or to stdout as JSON with --json. The output is written to a temporary
directory beside it and renamed into place, so a failed run never leaves a half-written model.

A model with external data is read without it: its weights stay on disk through the passes and
are streamed into OUT.onnx.data (passes/writer.py), so memory does not grow with the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from fuselm.converter.errors import UserError

# Beyond this many weight bytes (or when the input had them), weights go to OUT.onnx.data:
# protobuf cannot serialize a model past 2 GB.
_EXTERNAL_BYTES = 1 << 30


def _load(path: Path):  # noqa: ANN202 - onnx.ModelProto
    import onnx
    from google.protobuf.message import DecodeError

    if not path.is_file():
        raise UserError(f"{path}: no such file")
    from fuselm.passes.weights import check_external

    try:
        model = onnx.load(str(path), load_external_data=False)
        check_external(model, path.parent)  # the weights are read later, but must be there
    except (DecodeError, ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    if not model.graph.node:  # protobuf reads an empty file as an empty model
        raise UserError(f"{path} holds no ONNX graph (an empty or non-ONNX file); pass a "
                        "decoder .onnx model")
    return model


def _weight_bytes(model) -> int:  # noqa: ANN001
    return sum(len(t.raw_data) for t in model.graph.initializer)


def _referenced(model_file: Path) -> set[str]:
    """The external data files an existing ONNX model points at (none if it is unreadable)."""
    import onnx

    try:
        model = onnx.load(str(model_file), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a model we wrote: nothing of ours to keep or remove
        return set()
    return {e.value for t in model.graph.initializer for e in t.external_data
            if e.key == "location"}


def _data_names(out: Path) -> tuple[str, set[str]]:
    """The data file name for the new OUT.onnx, and the old model's data files it replaces.

    OUT.onnx.data, unless the model being replaced still reads that name: then the other of two
    names, so renaming the model is the single commit point (old model + old data, or new model
    + new data; a kill never pairs a model with the other's weights)."""
    names = (out.name + ".data", out.name + ".alt.data")
    used = _referenced(out) if out.is_file() else set()
    return next((n for n in names if n not in used), names[0]), used & set(names)


def save_atomic(  # noqa: ANN001 - model: onnx.ModelProto
    model, out: Path, external: bool, base_dir: Path | None = None,
    deferred: dict | None = None,
) -> None:
    """Write `out` (and its data file when external) via a temporary directory + rename.

    External: weights are streamed from `base_dir`'s data file and `deferred` values, as
    run_pipeline left them (passes/writer.py). The data file is renamed in first, under a name
    the model being replaced does not use, then the model; the old data file goes last.
    """
    import onnx

    from fuselm.passes.writer import write_model

    if out.is_dir():
        raise UserError(f"-o {out} is a directory; give the output model's file name, "
                        f"e.g. -o {out / 'model.onnx'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fuselm-", dir=out.parent))
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror}); choose another -o") from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        names, stale = [out.name], set()
        if external:
            data_name, stale = _data_names(out)
            write_model(model, tmp / out.name, base_dir=base_dir, deferred=deferred,
                        location=data_name)
            names.insert(0, data_name)  # the data first: the model never points at nothing
            stale.discard(data_name)
        else:
            onnx.save_model(model, str(tmp / out.name))
            stale = _data_names(out)[1]  # the old model's data: the new one is self-contained
        for name in names:
            os.chmod(tmp / name, 0o666 & ~umask)  # temp files are private; outputs are not
            os.replace(tmp / name, out.parent / name)
        for name in stale:
            (out.parent / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@click.command()
@click.argument("input_path", metavar="IN.onnx", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(path_type=Path),
              help="where to write the optimized model (OUT.onnx [+ OUT.onnx.data])")
@click.option("--passes", "pass_list", default=None, metavar="a,b,...",
              help="run only these passes (in pipeline order; cleanup always runs)")
@click.option("--json", "as_json", is_flag=True, help="print the pass report as JSON on stdout")
def optimize(input_path: Path, output_path: Path, pass_list: str | None, as_json: bool) -> None:
    """Fuse a decoder ONNX model: RMSNorm, RoPE, attention, QKV and Gate/Up pairing."""
    from fuselm.passes.manager import PipelineError, run_pipeline
    from fuselm.passes.model_io import check

    names = [p.strip() for p in pass_list.split(",") if p.strip()] if pass_list else None
    if output_path.is_dir():  # before the work, not after it
        raise UserError(f"-o {output_path} is a directory; give the output model's file name, "
                        f"e.g. -o {output_path / 'model.onnx'}")
    taken = {output_path.name, output_path.name + ".data", output_path.name + ".alt.data"}
    from fuselm.converter.out_dir import recorded_files

    if taken & recorded_files(output_path.parent):
        raise UserError(f"-o {output_path} is part of the fuselm artifact in "
                        f"{output_path.parent} (its fuselm.json records it): overwriting it would "
                        "break that artifact; write the optimized model elsewhere")
    model = _load(input_path)
    external = any(t.data_location == 1 for t in model.graph.initializer) or \
        _weight_bytes(model) > _EXTERNAL_BYTES
    external = external or (input_path.with_name(input_path.name + ".data")).exists()
    # External output: weights stay lazy (deferred) until the writer streams them.
    deferred: dict | None = {} if external else None
    base_dir = input_path.parent
    try:
        out, report = run_pipeline(model, names, base_dir=base_dir, deferred=deferred)
    except PipelineError as e:
        raise UserError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - e.g. the version converter on an odd graph
        raise UserError(f"{input_path}: cannot optimize ({type(e).__name__}: {e})") from e
    try:
        check(out)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"the optimized model fails onnx checks ({e}); please report this") from e
    save_atomic(out, output_path, external, base_dir, deferred)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console(file=sys.stderr).print(report.render())
