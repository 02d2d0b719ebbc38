"""The README's Python example runs; familiar flag spellings; hub ids offline; hints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.ux.conftest import ROOT, cli, cli_process


def test_readme_python_example_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code, "the README shows the Python API"
    r = subprocess.run([sys.executable, "-c", code.group(1)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((tmp_path / "tiny-onnx" / "fuselm.json").read_text())
    assert manifest["quantization"]["bits"] == 4
    assert re.search(r"(eos|length|stop_string) \d+(\.\d+)?", r.stdout), r.stdout


def test_import_fuselm_stays_light() -> None:
    code = ("import sys, fuselm; "
            "print(sorted(m for m in ('torch', 'mlx', 'onnx') if m in sys.modules)); "
            "print(fuselm.load.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split("\n")[:2] == ["[]", "fuselm.converter.api"], r.stderr


def test_familiar_run_flags(artifact: Path) -> None:
    a = cli("run", "-m", str(artifact), "--prompt", "Hi", "--max-tokens", "5", "--temp", "0.8",
            "--seed", "3", "--engine", "onnxruntime", "--json")
    b = cli("run", str(artifact), "--prompt", "Hi", "-n", "5", "--temperature", "0.8",
            "--seed", "3", "--engine", "onnxruntime", "--json")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]
    assert len(json.loads(a.stdout)["tokens"]) <= 5
    both = cli("run", str(artifact), "-m", str(artifact), "--prompt", "Hi")
    assert both.returncode == 2 and "MODEL or -m/--model" in both.stderr


def test_bench_grid_one_table(artifact: Path) -> None:
    r = cli("bench", "-m", str(artifact), "-p", "8,16", "-n", "4,6", "-r", "1",
            "--engine", "onnxruntime")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:5] == ["model", "size", "params", "quant", "engine"]
    tests = [ln.split()[-3] for ln in lines[1:5]]
    assert tests == ["pp8", "pp16", "tg4", "tg6"]
    assert all("Qwen3ForCausalLM" in ln and "float32" in ln for ln in lines[1:5])
    js = cli("bench", str(artifact), "-p", "8,16", "-n", "4", "-r", "1", "--engine",
             "onnxruntime", "--json")
    out = json.loads(js.stdout)
    assert [row["test"] for row in out["results"]] == ["pp8", "pp16", "tg4"]
    assert all(row["median"] > 0 for row in out["results"])


def test_convert_aliases_and_hub_offline(hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    r = cli("convert", str(hf_dir), "-o", str(out), "--q-bits", "4", "--q-group-size", "64",
            "--quiet")
    assert r.returncode == 0, r.stderr
    q = json.loads((out / "fuselm.json").read_text())["quantization"]
    assert q["bits"] == 4 and q["block_size"] == 64
    offline = cli_process("convert", "SomeOrg/Some-Model-0.5B", "-o", str(tmp_path / "h"),
                  env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://nonexistent.invalid"})
    assert offline.returncode == 2, offline.stderr
    assert offline.stderr.count("\n") == 1 and "Traceback" not in offline.stderr
    assert "`hf download SomeOrg/Some-Model-0.5B --local-dir Some-Model-0.5B`" in offline.stderr


def test_run_on_an_hf_dir_converts_it_into_the_cache(hf_dir: Path, artifact: Path) -> None:
    r = cli("run", str(hf_dir), "-p", "Hi", "-n", "4", "--engine", "onnxruntime", "--json")
    assert r.returncode == 0, r.stderr
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "fuselm" / "converted"
    assert f"(HF folder) once into {cache}" in r.stderr or f"using {cache}" in r.stderr
    # the default conversion of a float32 checkpoint: the same tokens as the float32 artifact
    assert json.loads(r.stdout)["tokens"] == _run_json(artifact, "-p", "Hi", "-n", "4")["tokens"]


def test_inspect_summary_first_and_collapsed(artifact: Path) -> None:
    r = cli("inspect", str(artifact))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.index("architecture") < out.index("input_ids")
    for label in ("parameters", "layers", "heads", "context", "dtype", "quantization",
                  "bits / weight", "per layer", "FusedQKV x2"):
        assert label in out
    assert "past_key_values.{0..1}.key" in out and "past_key_values.0.key" not in out
    full = cli("inspect", str(artifact), "--full").stdout
    assert "past_key_values.1.value" in full


def _run_json(artifact: Path, *args: str, input: str | None = None) -> dict:
    r = cli("run", str(artifact), "--engine", "onnxruntime", "--json", *args, input=input)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return {k: out[k] for k in ("tokens", "text", "prompt_tokens", "stop_reason")}


def test_prompt_flag_and_stdin(artifact: Path) -> None:
    want = _run_json(artifact, "--prompt", "Hi there", "-n", "4")
    assert _run_json(artifact, "-p", "Hi there", "-n", "4") == want
    assert _run_json(artifact, "-p", "-", "-n", "4", input="Hi there\n") == want
    assert _run_json(artifact, "-n", "4", input="Hi there\n") == want  # piped, no -p
    empty = cli("run", str(artifact), "-n", "4", input="")
    assert empty.returncode == 2 and "the prompt read from stdin is empty" in empty.stderr


def test_ctx_size_bounds_prompt_and_reply(artifact: Path) -> None:
    for flag in ("-c", "--ctx-size", "--max-kv-size"):
        out = _run_json(artifact, "-p", "Hi", "-n", "64", flag, "24")
        assert out["prompt_tokens"] + len(out["tokens"]) == 24, out
    over = cli("run", str(artifact), "-p", "Hi", "-c", "100000", "--engine", "onnxruntime")
    assert over.returncode == 2 and "--ctx-size 100000 is over the model's context (4096)" \
        in over.stderr
    short = cli("run", str(artifact), "-p", "Hi", "-c", "3", "--engine", "onnxruntime")
    line = _one_error_line(short)  # the window the user set, not "the model's context"
    assert "--ctx-size is 3" in line and "model's context" not in line, line


def test_system_message_goes_through_the_template(artifact: Path) -> None:
    from fuselm.runtime_metal.loaded_model import open_model
    from fuselm.runtime_metal.tokenizer import encode_prompt

    out = _run_json(artifact, "-p", "Hi", "--system", "Answer briefly.", "-n", "4")
    tok = open_model(artifact, "onnxruntime", defer_engine=True).tokenizer
    ids = encode_prompt(tok, "Hi", history=[{"role": "system", "content": "Answer briefly."}])
    assert "Answer briefly." in tok.decode(ids)
    assert out["prompt_tokens"] == len(ids) > len(encode_prompt(tok, "Hi"))
    raw = cli("run", str(artifact), "-p", "Hi", "--raw", "--system", "x")
    assert raw.returncode == 2 and "--system goes into the chat template" in raw.stderr


def test_min_p_flag(artifact: Path) -> None:
    greedy = _run_json(artifact, "-p", "Hi", "-n", "6")["tokens"]
    for seed in ("1", "2"):
        assert _run_json(artifact, "-p", "Hi", "-n", "6", "--temp", "2", "--seed", seed,
                         "--min-p", "1")["tokens"] == greedy
    bad = cli("run", str(artifact), "-p", "Hi", "--min-p", "1.5")
    assert bad.returncode == 2 and "min-p must be in [0, 1]" in bad.stderr


def test_serve_and_perplexity_take_dash_m(artifact: Path, tmp_path: Path) -> None:
    r = cli("serve", "-m", str(artifact), "--host", "0.0.0.0")
    assert r.returncode == 2 and "--api-key" in r.stderr  # got past the model to the bind check
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    a = cli("perplexity", "-m", str(artifact), "-f", str(text), "--context", "32",
            "--engine", "onnxruntime", "--json")
    b = cli("perplexity", str(artifact), "--text", str(text), "--context", "32",
            "--engine", "onnxruntime", "--json")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["ppl"] == json.loads(b.stdout)["ppl"]


def test_convert_q(hf_dir: Path, tmp_path: Path) -> None:
    """-q is --quant q4 (--dtype bfloat16: tests/export/test_bfloat16.py)."""
    r = cli("convert", str(hf_dir), "-o", str(tmp_path / "q"), "-q", "--quiet")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "q" / "fuselm.json").read_text())
    assert manifest["quantization"]["bits"] == 4


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_a_flag_of_the_other_engine_is_refused_by_name(artifact: Path) -> None:
    """Each engine's own flags are refused by name on the other one (as --threads is on MLX),
    never taken and dropped: --accuracy-level (onnxruntime's), --device-sampling and
    --no-compile (MLX's); refused before the model loads."""
    mlx_acc = ["--engine", "mlx", "--accuracy-level", "0"]
    cases = [
        ("run", ["-p", "Hi", *mlx_acc], "--accuracy-level"),
        ("chat", mlx_acc, "--accuracy-level"),
        ("bench", ["-p", "8", "-n", "2", "-r", "1", *mlx_acc], "--accuracy-level"),
        ("perplexity", mlx_acc, "--accuracy-level"),
        ("serve", mlx_acc, "--accuracy-level"),
        ("run", ["-p", "Hi", "--engine", "onnxruntime", "--device-sampling"],
         "--device-sampling"),
        ("bench", ["-p", "8", "-n", "2", "-r", "1", "--engine", "onnxruntime", "--no-compile"],
         "--no-compile"),
        ("run", ["-p", "Hi", "--engine", "onnxruntime", "--kv-group-size", "32"],
         "--kv-group-size"),
    ]
    for command, args, flag in cases:
        line = _one_error_line(cli(command, str(artifact), *args, input="hi\n"))
        assert flag in line, (command, line)
    # --device-sampling where the host must sample: refused, not dropped
    for other in (["--logprobs", "2"], ["--json-object"]):
        line = _one_error_line(cli("run", str(artifact), "-p", "Hi", "--engine", "mlx",
                                   "--device-sampling", *other))
        assert "--device-sampling" in line and other[0] in line, line
    # on its own engine the flag is taken, and left out it is the engine's default
    r = cli("run", str(artifact), "-p", "Hi", "-n", "2", "--engine", "onnxruntime",
            "--accuracy-level", "0", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["engine"]["accuracy_level"] == 0, r.stderr
    r = cli("run", str(artifact), "-p", "Hi", "-n", "2", "--engine", "onnxruntime", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["engine"]["accuracy_level"] == 4, r.stderr


def test_convert_q_with_q_bits_is_mlx_lms_spelling(hf_dir: Path, tmp_path: Path) -> None:
    """`-q --q-bits 8` is mlx_lm.convert's 8-bit quantization (-q: quantize, --q-bits: how)."""
    for bits in ("8", "6"):
        r = cli("convert", str(hf_dir), "-o", str(tmp_path / bits), "-q", "--q-bits", bits,
                "--quiet")
        assert r.returncode == 0, r.stderr
        manifest = json.loads((tmp_path / bits / "fuselm.json").read_text())
        assert manifest["quantization"]["bits"] == int(bits)


def test_convert_flags_that_would_be_dropped_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    """A convert flag that another one overrules, or that has nothing to act on, is one error
    line naming it, before any work (no output folder)."""
    cases = [
        (["--quant", "q4", "--bits-budget", "4.4", "--block-size", "64"], "--block-size"),
        (["--no-optimize", "--passes", "qkv"], "--passes"),
        (["--quant-method", "minmax"], "--quant-method"),
        (["--no-calibration"], "--no-calibration"),
        (["--block-size", "64"], "--block-size"),  # nothing quantized
        (["--quant", "none", "--bits-budget", "4.5"], "--bits-budget"),
        (["--no-optimize", "--keep-intermediate"], "--keep-intermediate"),  # model.onnx is raw
    ]
    for args, flag in cases:
        out = tmp_path / "out"
        line = _one_error_line(cli("convert", str(hf_dir), "-o", str(out), *args))
        assert flag in line, (args, line)
        assert not out.exists()


def test_an_empty_or_graphless_onnx_file_is_refused(tmp_path: Path) -> None:
    """protobuf parses an empty file as an empty model: inspect and optimize name the file as
    no ONNX model (not an empty summary, exit 0, nor an 'optimized model fails its checks')."""
    for content in (b"", b"\x08\x07"):  # nothing; only an ir_version
        bad = tmp_path / "bad.onnx"
        bad.write_bytes(content)
        for args in (("inspect", str(bad)), ("optimize", str(bad), "-o", str(tmp_path / "o.onnx"))):
            line = _one_error_line(cli(*args))
            assert "bad.onnx" in line and "no ONNX graph" in line, line
        assert not (tmp_path / "o.onnx").exists()


def test_optimize_refuses_to_overwrite_an_artifacts_own_model(artifact: Path, tmp_path: Path
                                                              ) -> None:
    """`fuselm optimize ART/model.onnx -o ART/model.onnx` would replace a file the artifact's
    fuselm.json records (and its data file), leaving an artifact that no longer loads: refused
    by name before any work, every file as it was; beside the artifact it writes."""
    import shutil

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    before = {p.name: p.read_bytes() for p in art.iterdir() if p.is_file()}
    for out in ("model.onnx", "tokenizer.json"):
        line = _one_error_line(cli("optimize", str(art / "model.onnx"), "-o", str(art / out)))
        assert "fuselm artifact" in line and out in line, line
    assert {p.name: p.read_bytes() for p in art.iterdir() if p.is_file()} == before
    r = cli("optimize", str(art / "model.onnx"), "-o", str(tmp_path / "fused.onnx"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fused.onnx").is_file()
