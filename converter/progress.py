"""Rich progress on stderr (stdout stays clean for --json)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

stderr = Console(stderr=True)

_LABELS = {"trace": "tracing the decoder", "weights": "writing weights", "passes": "graph passes"}


@contextlib.contextmanager
def stage_progress(enabled: bool = True) -> Iterator:
    """Yield a callback `(stage, done, total)` that drives one progress bar per stage."""
    if not enabled:
        yield None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=stderr,
        transient=False,
    ) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(_LABELS.get(stage, stage), total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update
