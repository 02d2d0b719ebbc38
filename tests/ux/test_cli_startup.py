"""Help and argument errors answer without the heavy libraries: the command modules import torch,
onnxruntime, MLX, transformers, onnx, numba, ... only in the command bodies that use them. Each
command runs through the real entry point in a fresh interpreter, which lists at exit the
modules it loaded (the start-up time itself is measured in BENCHMARKS.md, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "onnxruntime", "mlx", "transformers", "onnx", "onnx_graphsurgeon", "numba",
         "tokenizers", "starlette", "uvicorn")
MARK = "loaded-heavy-modules:"

# main() ends in sys.exit; the atexit hook still runs and reports on stderr's last line
WRAPPER = f"""
import atexit, json, sys
heavy = {HEAVY!r}
atexit.register(lambda: print({MARK!r}, json.dumps(sorted(
    {{m.split(".")[0] for m in sys.modules}} & set(heavy))), file=sys.stderr))
sys.argv = ["fuselm", *sys.argv[1:]]
from fuselm.converter.cli.main import main
main()
"""


def _loaded(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    r = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True,
                       timeout=120)
    last = r.stderr.rstrip().splitlines()[-1]
    assert last.startswith(MARK), r.stderr[-2000:]
    return r, json.loads(last.removeprefix(MARK))


@pytest.mark.parametrize("args", [[], ["run"], ["convert"], ["serve"]],
                         ids=["fuselm", "run", "convert", "serve"])
def test_help_imports_no_heavy_library(args: list[str]) -> None:
    r, heavy = _loaded(*args, "--help")
    assert r.returncode == 0 and "Usage: fuselm" in r.stdout, r.stderr[-2000:]
    assert heavy == [], f"`fuselm {' '.join(args)} --help` imported {heavy}"


@pytest.mark.parametrize("args, message", [
    (["run"], "give the model once"),
    (["convert", "--quant", "q9", "x", "-o", "y"], "'q9' is not one of"),
], ids=["run-without-model", "convert-unknown-quant"])
def test_argument_error_imports_no_heavy_library(args: list[str], message: str) -> None:
    r, heavy = _loaded(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert heavy == [], f"`fuselm {' '.join(args)}` imported {heavy}"
