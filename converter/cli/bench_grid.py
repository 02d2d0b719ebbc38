"""llama-bench's grid for `fuselm bench -p 128,512 -n 64,128`: one ppP row per prompt length
and one tgN row per generation length, in one table that names the model."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from fuselm.runtime_metal.artifact import Manifest


def int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """Click callback: "128,512" -> [128, 512], each >= the option's minimum."""
    low = 2 if param.name == "n" else 1
    try:  # an empty entry ("128,,512") is refused like any other non-integer
        out = [int(v) for v in str(value).split(",")]
    except ValueError:
        raise click.BadParameter(f"want comma-separated integers, got {value!r}") from None
    if not out or any(v < low for v in out):
        raise click.BadParameter(f"want integers >= {low}, got {value!r}")
    return out


@dataclass
class Row:
    test: str  # ppP | tgN
    median: float
    stdev: float


def model_columns(out_dir: str | Path, manifest: Manifest) -> dict[str, str]:
    from fuselm.runtime_metal.artifact_paths import confined
    from fuselm.runtime_metal.model_size import human, parameter_count

    data = confined(Path(out_dir), manifest.files.get("data", "model.onnx.data"),
                    f"{Path(out_dir) / 'fuselm.json'}'s files.data")
    size = data.stat().st_size if data.is_file() else 0
    q = manifest.quantization
    quant = (f"q{q.get('bits', 4)} g{q.get('block_size', '?')}" if q else manifest.dtype)
    return {"model": f"{manifest.model.architecture} ({Path(out_dir).name})",
            "size": f"{size / 2**20:.1f} MiB", "params": human(
                parameter_count(manifest.model)), "quant": quant}


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int) -> Iterator[Callable[[str], Callable[[int, int],
                                                                              None]]]:
    """Yield `start(label)` -> the run_bench on_run callback for that cell; a rich bar on
    stderr when it is a terminal, nothing otherwise."""
    if not enabled:
        yield lambda label: (lambda done, total: None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from fuselm.converter.progress import stderr

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=stderr, transient=True) as bar:
        overall = bar.add_task("bench", total=total)

        def start(label: str) -> Callable[[int, int], None]:
            task = bar.add_task(f"  {label}", total=None)

            def on_run(done: int, runs: int) -> None:
                bar.update(task, completed=done, total=runs)
                if done == runs:
                    bar.advance(overall)
                    bar.remove_task(task)

            return on_run

        yield start


def table(cols: dict[str, str], engine: str, rows: list[Row]) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(box=None)
    for name in (*cols, "engine", "test", "t/s", "±"):
        t.add_column(name, justify="right" if name in ("t/s", "±") else "left")
    for r in rows:
        t.add_row(*cols.values(), engine, r.test, f"{r.median:.2f}", f"{r.stdev:.2f}")
    buf = io.StringIO()
    Console(file=buf, width=200).print(t)
    return buf.getvalue().rstrip()


def run_grid(out_dir: str, ps: list[int], ns: list[int], r: int, name: str,
             start: Callable[[str], Callable[[int, int], None]], **options: Any) -> list[Row]:
    """ppP with a P-token prompt; tgN after a 1-token prompt (llama-bench's tg starts from an
    empty context)."""
    from fuselm.runtime_metal.bench import run_bench

    rows = []
    for p in ps:
        res = run_bench(out_dir, p, 2, r, name, on_run=start(f"pp{p}"), **options)
        rows.append(Row(f"pp{p}", res.pp_stats.median, res.pp_stats.stdev))
    for n in ns:
        res = run_bench(out_dir, 1, n, r, name, on_run=start(f"tg{n}"), **options)
        rows.append(Row(f"tg{n}", res.tg_stats.median, res.tg_stats.stdev))
    return rows
