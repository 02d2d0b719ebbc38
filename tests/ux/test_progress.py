"""Long jobs show a running value on stderr (converter/progress.py, the one mechanism):
perplexity its PPL so far per chunk, validate its PPL phase per rung; stdout stays the result."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.ux.conftest import cli


def test_perplexity_reports_its_running_value(artifact: Path) -> None:
    r = cli("perplexity", str(artifact), "--context", "64", "--engine", "onnxruntime")
    assert r.returncode == 0, r.stderr
    ppl = re.search(r"PPL = (\d+\.\d+)", r.stdout).group(1)
    chunks = int(re.search(r"\((\d+) chunks", r.stdout).group(1))
    assert chunks > 1
    # the bar's last state: every chunk done, the running PPL equal to the final one
    assert re.search(rf"chunks .* {chunks}/{chunks} .* PPL {ppl}", r.stderr), r.stderr
    quiet = cli("perplexity", str(artifact), "--context", "64", "--engine", "onnxruntime",
                "--json")
    assert quiet.stderr == "" and json.loads(quiet.stdout)["chunks"] == chunks


def test_validate_reports_its_ppl_phase(hf_dir: Path, artifact: Path) -> None:
    r = cli("validate", str(hf_dir), str(artifact), "-n", "2", "--context", "64")
    assert r.returncode == 0, r.stderr
    for rung in ("hf", "onnxruntime"):
        ppl = re.search(rf"PPL {rung}\s+(\d+\.\d+)", r.stdout).group(1)
        assert re.search(rf"PPL {rung} .* (\d+)/\1 .* {ppl}", r.stderr), r.stderr
