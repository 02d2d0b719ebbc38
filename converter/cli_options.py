"""Options several commands share in the spellings users know from mlx-lm and llama.cpp."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click


def model_argument(f: Callable[..., Any]) -> Callable[..., Any]:
    """OUT_DIR as a positional argument or as `-m/--model` (mlx-lm / llama.cpp spelling)."""
    f = click.option("-m", "--model", "model_opt", default=None, metavar="OUT_DIR",
                     type=click.Path(file_okay=False),
                     help="the artifact folder (same as the OUT_DIR argument)")(f)
    f = click.argument("out_dir", required=False, type=click.Path(file_okay=False))(f)

    @functools.wraps(f)
    def wrapper(*args: Any, out_dir: str | None = None, model_opt: str | None = None,
                **kwargs: Any) -> Any:
        if (out_dir is None) == (model_opt is None):
            raise click.UsageError("give the artifact folder once: OUT_DIR or -m/--model")
        return f(*args, out_dir=out_dir or model_opt, **kwargs)

    return wrapper
