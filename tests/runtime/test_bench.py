"""`fuselm bench`: the command runs and its JSON has llama-bench's keys (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fuselm.converter.cli.main import cli
from fuselm.runtime_metal.errors import RuntimeUserError


@pytest.mark.parametrize("engine", ["mlx", "onnxruntime"])
def test_bench_json_keys(engine: str, qwen3_artifact) -> None:  # noqa: ANN001
    res = CliRunner().invoke(cli, ["bench", str(qwen3_artifact), "-p", "16", "-n", "8", "-r",
                                   "2", "--engine", engine, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in ("pp", "tg", "pp_stats", "tg_stats", "device", "engine", "peak_memory_bytes",
                "prompt_tokens", "new_tokens", "runs"):
        assert key in out
    assert out["pp"] == out["pp_stats"]["median"] > 0 and out["tg"] > 0
    assert len(out["tg_stats"]["runs"]) == 2 and out["prompt_tokens"] == 16
    assert out["engine"]["engine"] == engine
    if engine == "mlx":
        assert out["engine"]["decode"] == "compiled"


def test_bench_table_and_profile(qwen3_artifact) -> None:  # noqa: ANN001
    res = CliRunner().invoke(cli, ["bench", str(qwen3_artifact), "-p", "16", "-n", "4", "-r",
                                   "1", "--engine", "mlx", "--profile"])
    assert res.exit_code == 0, res.output
    assert "pp16" in res.output and "tg4" in res.output and "Attention" in res.output
    bad = CliRunner().invoke(cli, ["bench", str(qwen3_artifact), "--engine", "onnxruntime",
                                   "--profile"])
    assert bad.exit_code != 0


def test_threads_flag_reaches_onnxruntime(qwen3_artifact, tmp_path) -> None:  # noqa: ANN001
    """-t/--threads sets onnxruntime's intra-op threads (bench, run, perplexity report them or
    run with them); with the MLX engine it is one clear error, not ignored."""
    res = CliRunner().invoke(cli, ["bench", str(qwen3_artifact), "-p", "8", "-n", "4", "-r",
                                   "1", "--engine", "onnxruntime", "-t", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["engine"]["threads"] == 1
    ran = CliRunner().invoke(cli, ["run", str(qwen3_artifact), "--prompt-ids", "1,2,3", "-n",
                                   "2", "--engine", "onnxruntime", "--threads", "1", "--json"])
    assert ran.exit_code == 0, ran.output
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 8)
    ppl = CliRunner().invoke(cli, ["perplexity", str(qwen3_artifact), "--engine", "onnxruntime",
                                   "--threads", "1", "--context", "16", "--text", str(text),
                                   "--json"])
    assert ppl.exit_code == 0, ppl.output
    for command in (["bench", "-p", "8", "-n", "4"], ["run", "--prompt-ids", "1,2"],
                    ["perplexity", "--context", "16"]):
        bad = CliRunner().invoke(cli, [command[0], str(qwen3_artifact), *command[1:],
                                       "--engine", "mlx", "--threads", "2"])
        assert isinstance(bad.exception, RuntimeUserError), bad.output
        assert "--threads sets onnxruntime's threads" in str(bad.exception)
    # through the real entry point: one line on stderr, exit code 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "fuselm.converter.cli.main", "run",
                           str(qwen3_artifact), "--prompt-ids", "1,2", "--engine", "mlx",
                           "-t", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --threads sets onnxruntime's threads")
    assert "Traceback" not in proc.stderr
