"""Session-scoped tiny models for the user-facing commands (chat, validate, API, report)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuselm.converter.models.builtin import build_model

ROOT = Path(__file__).resolve().parents[2]
FUSELM = str(Path(sys.executable).with_name("fuselm"))


def convert(model_dir: Path, out_dir: Path, **options: object) -> Path:
    from fuselm.converter.pipeline import ConvertOptions
    from fuselm.converter.pipeline import convert as run_convert

    run_convert(model_dir, out_dir, ConvertOptions.from_flags(**{"dtype": "float32", **options}))
    return out_dir


def cli_process(*args: str, input: str | bytes | None = None,
                env: dict[str, str] | None = None, timeout: int = 300
                ) -> subprocess.CompletedProcess:
    """`fuselm ARGS` in a subprocess (for what must be read at start-up: environment)."""
    return subprocess.run([FUSELM, *args], input=input, capture_output=True, timeout=timeout,
                          text=not isinstance(input, bytes), env={**os.environ, **(env or {})})


def cli(*args: str, input: str | bytes | None = None) -> subprocess.CompletedProcess:
    """The real entry point (`fuselm.converter.cli.main:main`: error lines, exit codes) run in this
    process with stdin/stdout/stderr swapped, so each call does not pay the imports again."""
    from click.testing import CliRunner

    from fuselm.converter.cli.main import main

    code = 0
    argv = sys.argv
    with CliRunner().isolation(input=input) as (out, err, _):
        sys.argv = ["fuselm", *args]
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = argv
        stdout, stderr = out.getvalue(), err.getvalue()  # type: ignore[union-attr]
    if isinstance(input, bytes):
        return subprocess.CompletedProcess(args, code, stdout, stderr)
    return subprocess.CompletedProcess(args, code, stdout.decode(errors="replace"),
                                       stderr.decode(errors="replace"))


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """GGUF files and HF folders given to run, validate, load ... convert into the cache:
    this session's own, never the user's ~/.cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3 checkpoint (GQA, head_dim != hidden/heads) with a long context for chat."""
    return build_model(tmp_path_factory.mktemp("ux") / "hf", "qwen3", seed=3,
                       max_position_embeddings=4096)


@pytest.fixture(scope="session")
def artifact(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(hf_dir, tmp_path_factory.mktemp("ux") / "out")
