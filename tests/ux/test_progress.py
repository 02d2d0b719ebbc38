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


def test_a_job_refused_before_its_first_bar_prints_only_the_error(artifact: Path,
                                                                  tmp_path: Path) -> None:
    """No empty bar display before the one error line of a job that fails at its start."""
    for args in (("convert", str(tmp_path / "missing"), "-o", str(tmp_path / "out")),
                 ("perplexity", str(artifact), "--context", "5", "--engine", "onnxruntime")):
        r = cli(*args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") \
            and r.stderr.count("\n") == 1, repr(r.stderr)


def test_convert_bars_end_complete(hf_dir: Path, tmp_path: Path) -> None:
    r = cli("convert", str(hf_dir), "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    passes = next(ln for ln in r.stderr.splitlines() if ln.startswith("graph passes"))
    assert " 1/1 " in passes, passes
