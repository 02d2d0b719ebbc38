"""`fuselm optimize`: the command on real files, opset upgrade, JSON report, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from passes_support import decoder_feeds, max_rel, op_counts, run

from fuselm.converter.cli.optimize_cmd import optimize
from fuselm.converter.errors import UserError


@pytest.fixture(scope="module")
def opset17_file(foreign, tmp_path_factory) -> Path:  # noqa: ANN001
    path = tmp_path_factory.mktemp("opt") / "in.onnx"
    onnx.save(foreign("qwen3", "torchscript-cache"), str(path))
    return path


def test_optimize_upgrades_and_fuses(opset17_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "out.onnx"
    r = CliRunner().invoke(optimize, [str(opset17_file), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["opset_upgraded_from"] == 17
    model = onnx.load(str(out))
    assert next(o.version for o in model.opset_import if o.domain == "") == 23
    assert op_counts(model)["FusedQKV"] == 2
    raw = onnx.load(str(opset17_file))
    feeds = decoder_feeds(raw)
    assert max_rel(run(model, feeds), run(raw, feeds)) <= 1e-5
    assert [p.name for p in out.parent.iterdir()] == ["out.onnx"]  # no temp files left


def test_optimize_subset_of_passes(opset17_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    r = CliRunner().invoke(optimize, [str(opset17_file), "-o", str(out),
                                      "--passes", "dead_shape,rmsnorm", "--json"])
    assert r.exit_code == 0, r.output
    names = [p["name"] for p in json.loads(r.stdout)["passes"]]
    assert names == ["dead_shape", "rmsnorm", "cleanup"]
    counts = op_counts(onnx.load(str(out)))
    assert counts["RMSNormalization"] == 9 and "FusedQKV" not in counts


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda d: d / "missing.onnx", [], "no such file"),
        (lambda d: (d / "junk.onnx").write_bytes(b"not onnx at all") and d / "junk.onnx", [],
         "not a readable ONNX model"),
        (None, ["--passes", "rmsnorm,bogus"], "unknown pass 'bogus'"),
    ],
)
def test_bad_input_is_one_clear_error(make, args, message, opset17_file: Path,  # noqa: ANN001
                                      tmp_path: Path) -> None:
    src = make(tmp_path) if make else opset17_file
    out = tmp_path / "out.onnx"
    r = CliRunner().invoke(optimize, [str(src), "-o", str(out), *args])
    assert isinstance(r.exception, UserError) and message in str(r.exception)
    assert not out.exists()


def test_cli_prints_one_line(tmp_path: Path) -> None:
    """Through the real entry point: one `error:` line on stderr, exit code 2, no traceback."""
    import subprocess
    import sys

    code = ("import sys, click; from fuselm.converter.cli.optimize_cmd import optimize; "
            "from fuselm.converter.errors import UserError\n"
            "try:\n    optimize.main(sys.argv[1:], standalone_mode=False)\n"
            "except UserError as e:\n    print(f'error: {e}', file=sys.stderr); sys.exit(2)")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nope.onnx"), "-o",
                        str(tmp_path / "o.onnx")], capture_output=True, text=True,
                       cwd=Path(__file__).parents[2])
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.onnx'}: no such file"]
