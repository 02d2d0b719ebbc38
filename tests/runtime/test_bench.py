"""`fuselm bench`: the command runs and its JSON has llama-bench's keys (no timing assertions)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fuselm.converter.cli import cli


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
