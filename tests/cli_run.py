"""Drive the `fuselm` CLI in-process (fast) and read its one-line errors."""

from __future__ import annotations

import sys

import pytest

from fuselm.converter.cli.main import main


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """Run `fuselm ARGS`; return (exit code, stdout, stderr). A traceback is always a
    failure."""
    old = sys.argv
    sys.argv = ["fuselm", *args]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """Run `fuselm ARGS`; return (exit code, stderr)."""
    code, _, err = run_cli(capsys, *args)
    return code, err


def one_error(code: int, err: str) -> str:
    """The single `error:` line of a refused command (exit 2)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]
