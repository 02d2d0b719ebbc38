"""`fuselm report OUT_DIR -o report.html`: one self-contained HTML page about an artifact."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import click

from fuselm.converter.errors import UserError


def _node_dicts(nodes: list[Any]) -> list[dict[str, Any]]:
    return [{"op": n.op_type, "domain": n.domain, "name": n.name, "inputs": list(n.input),
             "outputs": list(n.output)} for n in nodes]


def _hist_before(after: dict[str, int], passes: list[dict[str, Any]]) -> dict[str, int]:
    """The input graph's op histogram: the final one with every pass's op delta undone."""
    hist = dict(after)
    for e in passes:
        for op, d in e.get("op_delta", {}).items():
            hist[op] = hist.get(op, 0) - int(d)
    return {k: v for k, v in hist.items() if v > 0}


def quant_errors(quantization: dict[str, Any] | None) -> tuple[dict[str, float] | None, str]:
    """Per-tensor Q4 error (relative RMS) from fuselm.json's quantization record, as
    `fuselm quant-report` reads it."""
    from fuselm.converter.cli.quant_report_cmd import rows

    if not quantization:
        return None, "not quantized: the artifact's weights are in floating point"
    tensors = quantization.get("tensors") or []
    if not tensors or any("rel_rms_error" not in t for t in tensors):
        return None, "not recorded: this artifact's fuselm.json has no per-tensor Q4 error"
    return ({r["name"]: float(r["rel_rms_error"]) for r in rows(quantization)},
            "relative RMS error per tensor (worst first)")


def _profile(out_dir: str, measure: bool, profile_json: Path | None
             ) -> tuple[list[dict[str, Any]] | None, str]:
    if profile_json is not None:
        try:
            rows = json.loads(profile_json.read_text(encoding="utf-8")).get("profile")
        except (OSError, ValueError, AttributeError) as e:
            raise UserError(f"{profile_json} is not the JSON of `fuselm run --json --profile` "
                            f"({e})") from None
        if not rows:
            raise UserError(f"{profile_json} has no \"profile\" rows; make it with "
                            "`fuselm run OUT --prompt TEXT --engine mlx --profile --json`")
        return rows, f"from {profile_json}"
    if not measure:
        return None, "not measured: add --profile (or --profile-json FILE from `fuselm run " \
                     "--engine mlx --profile --json`)"
    from fuselm.converter.progress import stage_progress
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.bench import profile_rows

    vocab = read_manifest(out_dir).model.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(16)]
    with stage_progress() as bar:
        bar("profiling MLX node by node (tokens)", 0, 8)
        rows = profile_rows(out_dir, "mlx", prompt, 8, 512, on_token=lambda done: bar(
            "profiling MLX node by node (tokens)", done, 8))
    return rows, "16-token prompt, 8 new tokens, node by node after 2 warm-up passes " \
                 "(totals exceed a normal run; the ranking is the point)"


def build(out_dir: str, measure: bool, profile_json: Path | None) -> str:
    import onnx

    from fuselm.converter.cli.inspect_cmd import describe
    from fuselm.converter.cli.inspect_summary import summary
    from fuselm.converter.report.html import ReportData, render
    from fuselm.passes.layers import layer_window
    from fuselm.runtime_metal.artifact import read_manifest

    root = Path(out_dir)
    manifest = read_manifest(root)
    info = describe(root)
    nodes = list(onnx.load(info["path"], load_external_data=False).graph.node)
    passes_rec = manifest.passes or {}
    passes = list(passes_rec.get("passes", []))
    notes = []
    before = _hist_before(info["ops"], passes)
    layer_before = list(passes_rec.get("layer_before", []))
    raw = root / "raw.onnx"  # --keep-intermediate keeps the unfused export
    if not layer_before and raw.is_file():  # an artifact from before the report recorded it
        raw_nodes = list(onnx.load(str(raw), load_external_data=False).graph.node)
        layer_before = _node_dicts(layer_window(raw_nodes))
    if not passes:
        notes.append("no pass report in fuselm.json (converted with --no-optimize?)")
    profile, profile_note = _profile(out_dir, measure, profile_json)
    errors, quant_note = quant_errors(manifest.quantization)
    data = ReportData(
        title=f"fuselm report: {manifest.model.architecture} ({root.resolve().name})",
        summary=summary(root, info, nodes), passes=passes, hist_before=before,
        hist_after=info["ops"], layer_before=layer_before,
        layer_after=_node_dicts(layer_window(nodes)), profile=profile,
        profile_note=profile_note, quant_errors=errors, quant_note=quant_note, notes=notes)
    return render(data)


@click.command("report")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="HTML file to write (default: OUT_DIR/report.html)")
@click.option("--profile", "measure", is_flag=True,
              help="time each op with the MLX executor (a short generation) for the chart")
@click.option("--profile-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="use the per-op times of `fuselm run --engine mlx --profile --json`")
def report(out_dir: str, output: Path | None, measure: bool, profile_json: Path | None) -> None:
    """Write a self-contained HTML report of OUT_DIR: passes, one layer before/after fusion,
    per-op time, per-tensor Q4 error."""
    if measure and profile_json is not None:
        raise UserError("--profile measures the op times and --profile-json reads them from a "
                        "file; give one of them")
    html = build(out_dir, measure, profile_json)
    target = output or Path(out_dir) / "report.html"
    if target.is_dir():
        raise UserError(f"{target} is a directory; give -o a file name such as report.html")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        raise UserError(f"cannot write {target} ({e.strerror}); choose another -o") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    click.echo(f"wrote {target}", err=True)
