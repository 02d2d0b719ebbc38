"""The runtime configuration (fuselm/config.py): resolved from the environment and the options,
an option over the environment over the default; a bad value is one error line naming the
variable and its values; `fuselm inspect` and `--verbose` show every value and its source; the
README's table is the one the module writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fuselm.config import SETTINGS, ConfigError, RuntimeConfig, markdown_table, resolve
from fuselm.errors import FuselmError
from tests.ux.conftest import cli

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_environment_and_options() -> None:
    default = resolve({})
    assert default == RuntimeConfig()
    assert {src for _, _, src in default.rows()} == {"default"}
    assert default.kernel_folder() is not None and default.kernel_folder().name == "cuda"
    env = {"FUSELM_KERNELS": " OFF ", "FUSELM_ATTN_SPLIT": "0", "FUSELM_PREFILL_DENSE": "32",
           "MLX_MAX_OPS_PER_BUFFER": "45", "FUSELM_EXPORT": "torch",
           "FUSELM_KERNEL_DIR": "inline", "FUSELM_FOLD_NORM": "",  # empty: unset
           "FUSELM_GEMV_MMA": "4", "FUSELM_MICRO_BATCHES": "1"}
    c = resolve(env, threads=3, engine=None)  # None: the option was not given
    assert (c.kernels, c.attn_split, c.prefill_dense, c.mlx_max_ops_per_buffer, c.export,
            c.fold_norm, c.threads, c.engine, c.gemv_mma, c.micro_batches) == (
        "off", "0", 32, 45, "torch", "epilogue", 3, "auto", 4, 1)
    assert resolve({"FUSELM_GEMV_MMA": "auto"}).gemv_mma is None
    assert resolve({"FUSELM_MICRO_BATCHES": "Auto"}).micro_batches is None
    assert c.kernel_folder() is None  # inline
    assert c.source("kernels") == "environment (FUSELM_KERNELS)"
    assert c.source("fold_norm") == c.source("engine") == "default"
    assert c.source("threads") == "option (--threads)"
    # an option wins over the environment
    o = resolve(env, kernels="on")
    assert o.kernels == "on" and o.source("kernels") == "option (kernels)"
    assert resolve({"FUSELM_KERNEL_DIR": "~/k"}).kernel_folder() == Path("~/k").expanduser()


@pytest.mark.parametrize("name,value,allowed", [
    ("FUSELM_KERNELS", "fastest", "one of auto, on, off (default auto)"),
    ("FUSELM_FOLD_NORM", "chain", "one of epilogue, 0 (default epilogue)"),
    ("FUSELM_ATTN_SPLIT", "16", "one of auto, 0 (default auto)"),
    ("FUSELM_PREFILL_DENSE", "many", "auto (default) or a row count N (0: off)"),
    ("FUSELM_PREFILL_DENSE", "-1", "auto (default) or a row count N (0: off)"),
    ("FUSELM_GEMV_MMA", "on", "auto (default) or a row count N (0: off)"),
    ("MLX_MAX_OPS_PER_BUFFER", "0", "an operation count N >= 1 (default 60)"),
    ("FUSELM_MICRO_BATCHES", "0", "auto (default) or a count N >= 1 (1: off)"),
    ("FUSELM_EXPORT", "trace", "one of auto, torch (default auto)"),
])
def test_a_bad_value_names_the_variable_and_its_values(name: str, value: str,
                                                       allowed: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve({name: value})
    assert str(e.value) == f"{name}={value!r}: use {allowed}"
    assert isinstance(e.value, FuselmError)


def test_built_directly_it_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="FUSELM_KERNELS='fast'"):
        RuntimeConfig(kernels="fast")
    with pytest.raises(ConfigError, match="--threads 0"):
        resolve({}, threads=0)
    with pytest.raises(TypeError, match="no such option: gpu"):
        resolve({}, gpu=True)


def test_cli_bad_value_is_one_error_line(artifact: Path, hf_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the CLI: one `error:` line, exit code non-zero, no traceback, no output written
    by a conversion refused for it."""
    monkeypatch.setenv("FUSELM_FOLD_NORM", "chain")
    r = cli("run", str(artifact), "--prompt-ids", "1,2", "-n", "2")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: FUSELM_FOLD_NORM='chain': use one of epilogue, 0 (default epilogue)"]
    monkeypatch.delenv("FUSELM_FOLD_NORM")
    monkeypatch.setenv("FUSELM_EXPORT", "trace")
    r = cli("convert", str(hf_dir), "-o", str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if "error:" in ln] == [
        "error: FUSELM_EXPORT='trace': use one of auto, torch (default auto)"]
    assert not (tmp_path / "out" / "model.onnx").exists()


def _rows(text: str) -> dict[str, tuple[str, str]]:
    """--verbose's lines: name -> (value, source)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s+(FUSELM_\w+|MLX_\w+|--\w+)\s+(\S+)\s+(.+?)\s*$", line)
        if m:
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


def test_verbose_shows_each_value_and_its_source(artifact: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSELM_KERNELS", "off")
    r = cli("run", str(artifact), "--prompt-ids", "1,2", "-n", "2", "--engine", "onnxruntime",
            "-t", "2", "--verbose")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stderr)
    assert set(rows) == {s.env for s in SETTINGS} | {"--engine", "--threads"}
    assert rows["FUSELM_KERNELS"] == ("off", "environment (FUSELM_KERNELS)")
    assert rows["FUSELM_FOLD_NORM"] == ("epilogue", "default")
    assert rows["--engine"] == ("onnxruntime", "option (--engine)")
    assert rows["--threads"] == ("2", "option (--threads)")
    quiet = cli("run", str(artifact), "--prompt-ids", "1,2", "-n", "2", "--engine",
                "onnxruntime")
    assert not _rows(quiet.stderr)
    b = cli("bench", str(artifact), "-p", "8", "-n", "4", "-r", "1", "--engine", "onnxruntime",
            "--verbose")
    assert b.returncode == 0, b.stderr
    rows = _rows(b.stderr)
    assert rows["--threads"] == ("auto", "default")
    assert rows["FUSELM_KERNELS"] == ("off", "environment (FUSELM_KERNELS)")


def test_inspect_shows_the_configuration(artifact: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSELM_ATTN_SPLIT", "0")
    js = json.loads(cli("inspect", str(artifact), "--json").stdout)
    got = {r["name"]: (r["value"], r["source"]) for r in js["runtime_config"]}
    assert got["FUSELM_ATTN_SPLIT"] == ("0", "environment (FUSELM_ATTN_SPLIT)")
    assert got["FUSELM_KERNELS"] == ("auto", "default")
    assert set(got) == {s.env for s in SETTINGS} | {"--engine", "--threads"}
    text = cli("inspect", str(artifact)).stdout
    assert "runtime configuration" in text and "FUSELM_ATTN_SPLIT" in text


def test_readme_documents_every_setting_in_one_table() -> None:
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme
    # the table is the only place that names them: no setting described in the prose
    # outside it
    outside = readme.replace(markdown_table(), "")
    assert [s.env for s in SETTINGS if f"{s.env}=" in outside] == []
