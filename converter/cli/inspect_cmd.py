"""`fuselm inspect`: a model's I/O signature and op histogram, without loading its weights."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

from fuselm.converter.errors import UserError

if TYPE_CHECKING:  # onnx is imported where a model is read: `fuselm --help` answers without it
    import onnx


class _Stdout(Console):
    def on_broken_pipe(self) -> None:
        # rich exits 1 here; a reader that stopped early (`| head`) is no error: the CLI's
        # BrokenPipeError handler exits 0
        raise BrokenPipeError

def _shape(vi: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def describe(path: Path) -> dict[str, Any]:
    """I/O signature, op histogram and weight sizes of an ONNX model (file or artifact dir)."""
    import onnx

    if path.is_dir():
        path = path / "model.onnx"
    if not path.is_file():
        raise UserError(f"{path} not found; pass a .onnx file or a fuselm output directory")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and friends: all mean "not ONNX"
        raise UserError(f"{path} is not a readable ONNX model ({type(e).__name__})") from e
    if not model.graph.node:  # protobuf reads an empty file as an empty model
        raise UserError(f"{path} holds no ONNX graph (an empty or non-ONNX file); pass a .onnx "
                        "model or a fuselm output directory")
    hist = Counter(
        f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        for n in model.graph.node
    )
    weight_bytes = 0
    for t in model.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        weight_bytes += int(ext.get("length", 0)) if ext else len(t.raw_data)

    types = {v: k.lower() for k, v in onnx.TensorProto.DataType.items()}

    def io(vis: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": v.name,
                "type": types.get(v.type.tensor_type.elem_type, "?"),
                "shape": _shape(v),
            }
            for v in vis
        ]

    return {
        "path": str(path),
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "inputs": io(model.graph.input),
        "outputs": io(model.graph.output),
        "nodes": len(model.graph.node),
        "ops": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        "functions": sorted(f"{f.domain}.{f.name}" for f in model.functions),
        "initializers": len(model.graph.initializer),
        "weight_bytes": weight_bytes,
    }


@click.command("inspect")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.option("--full", is_flag=True, help="Every I/O row (KV rows are collapsed otherwise).")
@click.option("--parallel", type=click.Choice(["tensor", "pipeline"]), default=None,
              help="say instead whether the artifact splits this way over -n ranks (`run "
              "--parallel`), and the weight bytes each rank reads; exit 1 when it does not")
@click.option("-n", "--ranks", type=click.IntRange(2), default=2, show_default=True,
              help="ranks for --parallel")
def inspect(model: Path, as_json: bool, full: bool, parallel: str | None = None,
            ranks: int = 2) -> None:
    """Show MODEL's (a .onnx file or an output directory) summary, I/O signature and op
    histogram."""
    import onnx

    if parallel:
        _split(model, parallel, ranks, as_json)
        return

    from fuselm.config import resolve
    from fuselm.converter.cli.inspect_summary import collapse_io, summary

    info = describe(model)
    nodes = list(onnx.load(info["path"], load_external_data=False).graph.node)
    rows = summary(model, info, nodes)
    # what an engine loading it here would run with (the options are the run command's)
    settings = resolve().rows()
    if as_json:
        click.echo(json.dumps({**info, "summary": dict(rows), "runtime_config": [
            {"name": n, "value": v, "source": src} for n, v, src in settings]}, indent=2))
        return
    head = Table(title=info["path"], show_header=False)
    head.add_column(style="bold")
    head.add_column()
    for label, value in rows:
        head.add_row(label, value)
    io = Table(title=f"inputs / outputs  opsets {info['opsets']}"
               + ("" if full else "  (--full: every row)"))
    for col in ("", "name", "type", "shape"):
        io.add_column(col)
    for kind in ("inputs", "outputs"):
        for v in info[kind] if full else collapse_io(info[kind]):
            io.add_row(kind[:-1], v["name"], v["type"], str(v["shape"]))
    ops = Table(title=f"{info['nodes']} nodes, {info['weight_bytes'] / 1e6:.1f} MB of weights")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for name, count in info["ops"].items():
        ops.add_row(name, str(count))
    config = Table(title="runtime configuration (this environment; README: Configuration)")
    for col in ("setting", "value", "source"):
        config.add_column(col)
    for row in settings:
        config.add_row(*row)
    console = _Stdout()
    console.print(head)
    console.print(io)
    console.print(ops)
    console.print(config)


def _split(out_dir: Path, mode: str, ranks: int, as_json: bool) -> None:
    """`inspect --parallel MODE -n N`: whether the artifact splits, and each rank's share."""
    from fuselm.runtime_metal.artifact import model_path, read_manifest
    from fuselm.runtime_metal.loader import read_model
    from fuselm.runtime_metal.mlx_engine.shard import split_report

    manifest = read_manifest(out_dir)
    graph = read_model(model_path(out_dir))
    total = sum(t.ByteSize() if not t.external_data else int(
        {e.key: e.value for e in t.external_data}.get("length", 0))
        for t in graph.graph.initializer)
    report = split_report(graph, mode, ranks, hidden=manifest.model.hidden_size,
                          vocab=manifest.model.vocab_size, dtype=manifest.dtype)
    info = manifest.model
    facts = {"mode": mode, "ranks": ranks, "splits": not report.error, "reason": report.error,
             "query_heads": info.num_heads, "kv_heads": info.num_kv_heads,
             "vocab": info.vocab_size, "layers": info.num_layers,
             "weight_bytes": total, "rank_weight_bytes": report.rank_bytes,
             "rank_layers": report.layers}
    if as_json:
        click.echo(json.dumps(facts))
    elif report.error:
        click.echo(f"{out_dir} does not split {mode}-parallel over {ranks} ranks: "
                   f"{report.error}")
    else:
        click.echo(f"{out_dir} splits {mode}-parallel over {ranks} ranks "
                   f"({info.num_heads} query / {info.num_kv_heads} KV heads, "
                   f"vocabulary {info.vocab_size}, "
                   f"{info.num_layers} layers); weights {total / 2**20:.1f} MiB")
        for r, b in enumerate(report.rank_bytes):
            layers = (f", layers {report.layers[r][0]}-{report.layers[r][1] - 1}"
                      if report.layers else "")
            click.echo(f"  rank {r}: {b / 2**20:.1f} MiB ({100 * b / max(total, 1):.0f} %)"
                       f"{layers}")
    if report.error:
        raise SystemExit(1)
