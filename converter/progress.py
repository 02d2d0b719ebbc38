"""Rich progress on stderr (stdout stays clean for --json): one bar per stage of a long job
(convert's stages, perplexity's chunks, validate's phases, report --profile), with a running
value beside it where the job has one (the PPL so far). The commands turn it off with --quiet
or --json; rich draws it live on a terminal and prints its last state otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

stderr = Console(stderr=True)

_LABELS = {"trace": "tracing the decoder", "weights": "writing weights", "passes": "graph passes"}
Update = Callable[..., None]  # (stage, done, total, value="")


@contextlib.contextmanager
def stage_progress(enabled: bool = True) -> Iterator:
    """Yield a callback `(stage, done, total, value="")` that drives one progress bar per
    stage; `value` is shown after the count (e.g. "PPL 12.34")."""
    if not enabled:
        yield None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[value]}"),
        console=stderr,
        transient=False,
    )
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int, value: str = "") -> None:
        if stage not in tasks:
            if not tasks:  # drawn from the first stage on: a job refused at its start
                bar.start()  # prints its error line alone, not after an empty display
            tasks[stage] = bar.add_task(_LABELS.get(stage, stage), total=total, value=value)
        bar.update(tasks[stage], completed=done, total=total, value=value)

    try:
        yield update
    finally:
        if tasks:
            bar.stop()
