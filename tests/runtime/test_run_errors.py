"""Run-time bad input: sampling options, NaN models, prompts, tokenizers, permissions, pipes.

Each ends in one `error:` line and exit code 2 (or, for a closed pipe, a quiet exit 0).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from fuselm.runtime_metal.integrity import tensor_ranges
from tests.runtime.conftest import rehash
from tests.runtime.test_integrity import ENGINES, cli, one_error


@pytest.fixture()
def art(qwen3_artifact: Path, tmp_path: Path) -> Path:
    out = tmp_path / "art"
    shutil.copytree(qwen3_artifact, out)
    return out


@pytest.mark.parametrize(("option", "value", "needle"), [
    ("--temperature", "nan", "temperature"),
    ("--temperature", "inf", "temperature"),
    ("--temperature", "-0.5", "temperature"),
    ("--repetition-penalty", "nan", "repetition penalty"),
    ("--repetition-penalty", "0", "repetition penalty"),
    ("--seed", "-1", "seed"),
    ("--top-p", "0", "top-p"),
    ("--top-p", "1.5", "top-p"),
    ("--top-p", "nan", "top-p"),
])
def test_bad_sampling_options(capsys, qwen3_artifact: Path, option: str, value: str,  # noqa: ANN001
                              needle: str) -> None:
    line = one_error(*cli(capsys, "run", str(qwen3_artifact), "--prompt-ids", "1,2",
                          option, value))
    assert needle in line and value.lstrip("-") in line


@pytest.fixture()
def nan_art(art: Path) -> Path:
    """The artifact with one whole weight tensor set to NaN (its hashes re-recorded, so only the
    values are wrong, as in a checkpoint that holds NaN)."""
    offset, length, _ = tensor_ranges(art / "model.onnx")["model.onnx.data"][0]
    with (art / "model.onnx.data").open("r+b") as f:
        f.seek(offset)
        f.write(np.full(length // 4, np.nan, np.float32).tobytes())
    rehash(art)
    return art


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.8"),
                                      ("--temperature", "0.8", "--top-p", "0.9")])
def test_nan_logits_stop_generation(capsys, nan_art: Path, engine: str,  # noqa: ANN001
                                    sampling: tuple[str, ...]) -> None:
    line = one_error(*cli(capsys, "run", str(nan_art), "--prompt-ids", "1,2", "-n", "3",
                          "--engine", engine, *sampling))
    assert "NaN logits" in line


def test_invalid_utf8_prompt(capsys, qwen3_artifact: Path) -> None:  # noqa: ANN001
    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # how argv delivers it
    line = one_error(*cli(capsys, "run", str(qwen3_artifact), "--prompt", prompt))
    assert "not valid UTF-8" in line and "\\xe9" in line


def test_missing_tokenizer_file(capsys, art: Path) -> None:  # noqa: ANN001
    (art / "tokenizer.json").unlink()
    line = one_error(*cli(capsys, "run", str(art), "--prompt", "hello"))
    assert "tokenizer.json" in line


@pytest.mark.parametrize(("template", "kind"), [
    ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),
    ("{% set x = [] %}{{ x.append(1) }}", "SecurityError"),
])
def test_broken_chat_template(capsys, art: Path, template: str, kind: str) -> None:  # noqa: ANN001
    (art / "chat_template.jinja").write_text(template)
    line = one_error(*cli(capsys, "run", str(art), "--prompt", "hello"))
    assert "chat template" in line and kind in line


@pytest.mark.parametrize("engine", ENGINES)
def test_tokenizer_ids_beyond_the_vocabulary(capsys, art: Path, engine: str) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(art))
    vocab = json.loads((art / "fuselm.json").read_text())["model"]["vocab_size"]
    extra = [f"<extra_{i}>" for i in range(vocab + 8 - len(tok))]
    tok.add_tokens(extra)
    tok.save_pretrained(str(art))
    line = one_error(*cli(capsys, "run", str(art), "--prompt", extra[-1], "--raw",
                          "--engine", engine))
    assert "outside the model's vocabulary" in line and f"[0, {vocab})" in line


def test_inspect_into_a_closed_pipe_exits_quietly(qwen3_artifact: Path) -> None:
    p = subprocess.Popen([sys.executable, "-m", "fuselm.converter.cli.main", "inspect",
                          str(qwen3_artifact)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # like `| head` that has read its lines
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0 and err == ""


PERMISSION_CASES = {
    "manifest": ("fuselm.json", ["--prompt-ids", "1,2", "--engine", "mlx"]),
    "data, mlx": ("model.onnx.data", ["--prompt-ids", "1,2", "--engine", "mlx"]),
    "data, onnxruntime": ("model.onnx.data", ["--prompt-ids", "1,2", "--engine", "onnxruntime"]),
    "tokenizer": ("tokenizer.json", ["--prompt", "hello", "--engine", "onnxruntime"]),
    "generation config": ("generation_config.json", ["--prompt-ids", "1,2",
                                                      "--engine", "onnxruntime"]),
}

# Runs as root, imports what the cases need, makes one file of each copy unreadable, then drops
# to `nobody` (uid 65534) and runs every case in-process; prints {case: [exit code, stderr]}.
_SCRIPT = r"""
import contextlib, io, json, os, sys, traceback
import mlx.core, onnxruntime, transformers, jinja2, tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from fuselm.converter.cli import main as cli, run_cmd
import fuselm.runtime_metal.mlx_engine.engine, fuselm.runtime_metal.ort_engine.engine
import fuselm.runtime_metal.generate, fuselm.runtime_metal.tokenizer
import fuselm.runtime_metal.integrity, fuselm.runtime_metal.manifest_schema
cases = json.loads(sys.argv[1])
for art, file, _ in cases.values():
    os.chmod(os.path.join(art, file), 0)
os.setgid(65534)
os.setuid(65534)
results = {}
for name, (art, file, args) in cases.items():
    err = io.StringIO()
    sys.argv = ["fuselm", "run", art, *args]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            code, err = 1, io.StringIO(traceback.format_exc())
    results[name] = [code, err.getvalue()]
print(json.dumps(results))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops privileges with os.setuid, which needs root "
                    "(as a normal user the files would simply stay readable to their owner)")
def test_unreadable_files(qwen3_artifact: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="fuselm-perm-", dir="/tmp"))
    root.chmod(0o755)
    cases = {}
    for i, (case, (file, args)) in enumerate(PERMISSION_CASES.items()):
        art = root / f"art{i}"
        shutil.copytree(qwen3_artifact, art)
        for f in [art, *art.iterdir()]:
            f.chmod(0o755 if f.is_dir() else 0o644)
        cases[case] = (str(art), file, args)
    try:
        r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)],
                           capture_output=True, text=True, timeout=300,
                           cwd=str(Path(__file__).parents[2]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for case, (code, err) in results.items():
        lines = [ln for ln in err.splitlines() if ln.strip()]
        file = PERMISSION_CASES[case][0]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (case, err)
        assert file in lines[0] and "ermission denied" in lines[0], (case, err)
