"""Shared by the input-validation tests: the CLI driven in-process, and checkpoint surgery."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from fuselm.converter.cli.main import main


def run_cli(*args: str) -> tuple[int, str]:
    """(exit code, stderr) of `fuselm ARGS` run in this process. An exception that escapes
    main() is a traceback the user would see: it propagates and fails the test."""
    err = io.StringIO()
    code = 0
    with (
        mock.patch.object(sys, "argv", ["fuselm", *args]),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, err.getvalue()


def error_line(code: int, stderr: str) -> str:
    """The single `error:` line of a refused run (asserting that it is one)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, (code, stderr)
    assert "Traceback" not in stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def copy_model(good: Path, dest: Path) -> Path:
    shutil.copytree(good, dest, symlinks=True)
    return dest


def edit_config(model: Path, **changes: Any) -> None:
    path = model / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def split_safetensors(path: Path) -> tuple[Any, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(path: Path, header: Any, body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edit_header(model: Path, edit: Callable[[dict], Any]) -> None:
    """Rewrite model.safetensors's header with `edit(header)` (its return value replaces the
    header when not None); the data bytes stay as they were."""
    path = model / "model.safetensors"
    header, body = split_safetensors(path)
    result = edit(header)
    write_safetensors(path, header if result is None else result, body)


def edit_tensors(model: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
