"""Each malformed input of the reliability issues (17, 18) as a regression: convert refuses it
with one `error:` line (exit 2) naming the problem, before any output exists."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fuselm.export.errors import ExportError
from fuselm.export.safetensors.checkpoint import Checkpoint
from fuselm.export.tensor_match import check_tensor_names
from fuselm.export.weight_screen import WeightScreen
from tests.export.inputs import (
    copy_model,
    edit_config,
    edit_header,
    edit_tensors,
    error_line,
    run_cli,
)

EMBED = "model.embed_tokens.weight"
UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def good(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("qwen3")  # the session's tiny Qwen3 (tests/export/conftest.py)


def _rope(theta: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def _set(tensors: dict, name: str, value: float, dtype: torch.dtype | None = None) -> None:
    if dtype is not None:
        for k in tensors:
            tensors[k] = tensors[k].to(dtype)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[5] = value


def _symlink_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(model / "config.json")


def _index(weight_map: object) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return edit


def _outside_shard(model: Path) -> None:
    # A complete, valid checkpoint outside the folder: without the check it converts (exit 0).
    outside = model.parent / "outside"
    outside.mkdir()
    os.replace(model / "model.safetensors", outside / "secret.safetensors")
    _index({EMBED: "../outside/secret.safetensors"})(model)


def _fewer_layers(model: Path) -> None:
    edit_config(model, num_hidden_layers=1, layer_types=["full_attention"])


def _extra_tensor(model: Path) -> None:
    edit_tensors(model, lambda t: t.__setitem__("model.extra_gate.weight", torch.ones(4)))


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _deep_field(name: str, n: int) -> Callable[[Path], None]:
    """A valid file with one extra field nested `n` deep (written as text: json.dumps recurses)."""
    def edit(model: Path) -> None:
        path = model / name
        path.write_text(path.read_text().rstrip()[:-1] + f', "x": {_deep(n)}}}')

    return edit


def _deep_header(model: Path) -> None:
    path = model / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + n].decode().rstrip()[:-1] + f', "__metadata__": {{"x": {_deep(100000)}}}}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + data[8 + n:])


def _weights_dir(model: Path) -> None:
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").mkdir()


# case -> (edit of a copy of the good model, extra convert args, words the error must hold)
CASES: dict[str, tuple[Callable[[Path], None], list[str], list[str]]] = {
    # config.json values
    "hidden_size string": (lambda m: edit_config(m, hidden_size="64"), [],
                           ["config.json", "hidden_size", '"64"', "integer"]),
    "hidden not divisible": (lambda m: edit_config(m, head_dim=None, hidden_size=66), [],
                             ["hidden_size 66", "not divisible", "num_attention_heads 4"]),
    "zero heads": (lambda m: edit_config(m, num_attention_heads=0), [],
                   ["num_attention_heads is 0", ">= 1"]),
    "negative vocab": (lambda m: edit_config(m, vocab_size=-5), [], ["vocab_size is -5"]),
    "eps string": (lambda m: edit_config(m, rms_norm_eps="1e-6"), [],
                   ["rms_norm_eps", '"1e-6"', "number > 0"]),
    "eos string": (lambda m: edit_config(m, eos_token_id="2"), [], ["eos_token_id", '"2"']),
    "eos beyond vocab": (lambda m: edit_config(m, eos_token_id=[2, 999]), [],
                         ["eos_token_id", "outside the vocabulary", "384"]),
    "null field": (lambda m: edit_config(m, intermediate_size=None), [],
                   ["intermediate_size is null"]),
    "zero layers": (lambda m: edit_config(m, num_hidden_layers=0), [],
                    ["num_hidden_layers is 0"]),
    "negative layers": (lambda m: edit_config(m, num_hidden_layers=-1), [],
                        ["num_hidden_layers is -1"]),
    "negative context": (lambda m: edit_config(m, max_position_embeddings=-1), [],
                         ["max_position_embeddings is -1"]),
    "rope_theta zero": (lambda m: edit_config(m, **_rope(0)), [],
                        ["rope_parameters.rope_theta is 0", "> 0"]),
    "rope_theta negative (4.x)": (lambda m: edit_config(m, rope_parameters=None, rope_theta=-1.0),
                                  [], ["rope_theta is -1.0"]),
    "architectures string": (lambda m: edit_config(m, architectures="Qwen3ForCausalLM"), [],
                             ["architectures", "a string", '["Qwen3ForCausalLM"]']),
    "kv heads do not divide": (lambda m: edit_config(m, num_key_value_heads=3), [],
                               ["num_key_value_heads 3"]),
    "config is a list": (lambda m: (m / "config.json").write_text("[1]"), [],
                         ["config.json", "JSON object"]),
    "generation_config eos string": (
        lambda m: (m / "generation_config.json").write_text('{"eos_token_id": "x"}'), [],
        ["generation_config.json", "eos_token_id", '"x"']),
    # safetensors headers
    "header is a list": (lambda m: edit_header(m, lambda h: [1, 2]), [],
                         ["not a valid safetensors", "JSON list"]),
    "no data_offsets": (lambda m: edit_header(m, lambda h: h[EMBED].pop("data_offsets") and None),
                        [], [EMBED, "data_offsets"]),
    "negative offsets": (lambda m: edit_header(m, lambda h: h[EMBED].update(data_offsets=[-4, 0])),
                         [], [EMBED, "[-4, 0]"]),
    "unknown dtype": (lambda m: edit_header(m, lambda h: h[EMBED].update(dtype="F99")), [],
                      [EMBED, "unknown dtype", "F99"]),
    "string shape": (lambda m: edit_header(m, lambda h: h[EMBED].update(shape="64")), [],
                     [EMBED, "shape", "integers"]),
    # JSON nested past any use (json's parser recurses once per level)
    "config.json nested 100,000 deep": (
        lambda m: (m / "config.json").write_text(_deep(100000)), [],
        ["config.json is not valid JSON", "nested deeper than 64"]),
    "config.json field nested 900 deep": (_deep_field("config.json", 900), [],
                                          ["config.json", "nested deeper than 64"]),
    "generation_config.json nested": (
        lambda m: (m / "generation_config.json").write_text(_deep(100000)), [],
        ["generation_config.json is not valid JSON", "nested deeper"]),
    "safetensors header nested 100,000 deep": (_deep_header, [],
                                               ["model.safetensors", "nested deeper"]),
    "index nested": (lambda m: (m / "model.safetensors.index.json").write_text(_deep(100000)),
                     [], ["index.json is not valid JSON", "nested deeper"]),
    "model.safetensors a directory": (_weights_dir, [],
                                      ["model.safetensors is a directory", "regular file"]),
    # index files
    "weight_map a list": (_index([1, 2]), [], ["index.json", "weight_map", "object"]),
    "shard outside the folder": (_outside_shard, [], ["../outside/secret.safetensors", "outside"]),
    "shard /etc/passwd": (_index({EMBED: "/etc/passwd"}), [], ["/etc/passwd", "outside"]),
    # tokenizer
    "broken tokenizer.json": (lambda m: (m / "tokenizer.json").write_text('{"model": 3}'), [],
                              ["tokenizer.json", "not a valid tokenizer"]),
    "tokenizer symlinked to another file": (_symlink_tokenizer, [], ["not a valid tokenizer"]),
    "tokenizer beyond vocab": (lambda m: edit_config(m, vocab_size=300), [],
                               ["tokenizer.json", "token id", "vocab_size is 300"]),
    "chat template syntax": (lambda m: (m / "chat_template.jinja").write_text("{% for %}"), [],
                             ["chat_template.jinja", "not a valid Jinja template"]),
    "chat template sandbox": (
        lambda m: (m / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}"), [],
        ["chat_template.jinja", "sandbox"]),
    # weights
    "NaN weight": (lambda m: edit_tensors(m, lambda t: _set(t, UP, float("nan"))), [],
                   [UP, "NaN", "--allow-nonfinite"]),
    "NaN weight, q4": (lambda m: edit_tensors(m, lambda t: _set(t, UP, float("nan"))),
                       ["--quant", "q4"], [UP, "NaN"]),
    "bf16 beyond float16": (
        lambda m: edit_tensors(m, lambda t: _set(t, UP, 1e6, torch.bfloat16)), [],
        [UP, "float16", "--dtype float32"]),
    "NaN weight allowed, q4": (lambda m: edit_tensors(m, lambda t: _set(t, UP, float("nan"))),
                               ["--quant", "q4", "--allow-nonfinite"], [UP, "without --quant"]),
    # checkpoint vs config
    "fewer layers in config": (_fewer_layers, [], ["2 decoder layers", "num_hidden_layers is 1"]),
    "unused tensor": (_extra_tensor, [], ["model.extra_gate.weight", "does not use"]),
    # --passes is checked before the export (the NaN weight would be the error otherwise)
    "unknown pass first": (lambda m: edit_tensors(m, lambda t: _set(t, UP, float("nan"))),
                           ["--passes", "rmsnorm,bogus"], ["unknown pass 'bogus'"]),
    # quantizing is a pass: without the passes the weights would stay float, the flag dropped
    "q4 without the passes": (lambda m: None, ["--quant", "q4", "--no-optimize"],
                              ["--quant q4", "--no-optimize"]),
    "q8 without the passes": (lambda m: None, ["--q-bits", "8", "--no-optimize"],
                              ["--quant q8", "--no-optimize"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_refused(case: str, good: Path, tmp_path: Path) -> None:
    edit, args, needles = CASES[case]
    model = copy_model(good, tmp_path / "model")
    edit(model)
    out = tmp_path / "out"
    optimize = [] if "--passes" in args or "--quant" in args else ["--no-optimize"]
    line = error_line(*run_cli("convert", str(model), "-o", str(out), "--quiet", *optimize, *args))
    for needle in needles:
        assert needle in line, line
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_allow_nonfinite_converts_and_records(good: Path, tmp_path: Path) -> None:
    model = copy_model(good, tmp_path / "model")
    edit_tensors(model, lambda t: _set(t, UP, float("inf")))
    out = tmp_path / "out"
    code, err = run_cli("convert", str(model), "-o", str(out), "--no-optimize", "--quiet",
                        "--allow-nonfinite")
    assert code == 0, err
    assert "warning" in err and UP in err
    manifest = json.loads((out / "fuselm.json").read_text())
    assert manifest["source"]["nonfinite_tensors"] == [UP]


def test_symlinked_shard_file_may_point_elsewhere(good: Path, tmp_path: Path) -> None:
    """The HF cache's layout: the shard is a link into a blob store outside the snapshot."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    model = copy_model(good, tmp_path / "snapshot")
    os.replace(model / "model.safetensors", blobs / "abc123")
    (model / "model.safetensors").symlink_to(blobs / "abc123")
    _index({EMBED: "model.safetensors"})(model)
    assert EMBED in Checkpoint(model).tensors


def test_weight_screen_ranges() -> None:
    big = torch.full((3,), 70000.0)
    WeightScreen(torch.float32)("w", big)  # float32 output: fine
    WeightScreen(torch.float16)("w", torch.full((3,), 65504.0))  # largest float16: fine
    with pytest.raises(ExportError, match="beyond float16's range"):
        WeightScreen(torch.float16)("w", big)
    screen = WeightScreen(torch.float16, allow_nonfinite=True)
    screen("a", torch.tensor([1.0, float("nan")]))
    screen("b", torch.ones(3))
    assert screen.nonfinite == ["a"]


def test_harmless_tensors_ignored(tmp_path: Path) -> None:
    want = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
    have = [*want, "model.layers.0.self_attn.rotary_emb.inv_freq", "lm_head.weight"]
    check_tensor_names(want, have, tmp_path, num_layers=1, tied=True)
    with pytest.raises(ExportError, match="lm_head.weight"):
        check_tensor_names(want, have, tmp_path, num_layers=1, tied=False)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json",
                                  "generation_config.json"])
def test_fifo_refused_not_waited_on(good: Path, tmp_path: Path, name: str) -> None:
    """A FIFO named model.safetensors used to block the first read forever; one named like a
    side file was skipped (the model converted without its tokenizer)."""
    model = copy_model(good, tmp_path / "model")
    (model / name).unlink()
    os.mkfifo(model / name)
    line = error_line(*run_cli("convert", str(model), "-o", str(tmp_path / "out"), "--quiet"))
    assert f"{name} is a FIFO" in line and "regular file" in line


def test_layer_claim_checked_before_building(good: Path, tmp_path: Path) -> None:
    """num_hidden_layers 1,000,000 over a 2-layer checkpoint: refused from the tensor table in
    seconds (it used to build a million-layer config and spec first: gigabytes, minutes)."""
    model = copy_model(good, tmp_path / "model")
    edit_config(model, num_hidden_layers=1_000_000, layer_types=None)
    t0 = time.monotonic()
    line = error_line(*run_cli("convert", str(model), "-o", str(tmp_path / "out"), "--quiet"))
    assert time.monotonic() - t0 < 30
    assert "num_hidden_layers is 1000000" in line and "stores 2 decoder layer(s)" in line


def test_tied_config_with_its_own_head_follows_transformers(good: Path, tmp_path: Path) -> None:
    """tie_word_embeddings true, but the checkpoint stores an lm_head.weight of other values:
    transformers 5.x does not tie then (it warns and loads the stored head), so the artifact
    uses the stored head too and its logits are transformers' (the head used to be dropped)."""
    import numpy as np
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from fuselm.runtime_metal.engine import make_engine

    model = copy_model(good, tmp_path / "model")
    tensors = load_file(str(model / "model.safetensors"))
    torch.manual_seed(0)
    tensors["lm_head.weight"] = torch.randn_like(tensors[EMBED])
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    code, err = run_cli("convert", str(model), "-o", str(out), "--quiet")
    assert code == 0, err
    assert json.loads((out / "fuselm.json").read_text())["model"]["tie_word_embeddings"] is False
    ids = [5, 17, 99, 200, 3]
    hf = AutoModelForCausalLM.from_pretrained(str(model))
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got = make_engine(out, "onnxruntime").forward(np.array([ids]), all_logits=True)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4


def test_model_safetensors_beside_an_index_of_other_shards_is_refused(good: Path,
                                                                       tmp_path: Path) -> None:
    """transformers loads model.safetensors and ignores the index beside it; fuselm read the
    index's shards: two different models from one folder. Refused, both named."""
    from safetensors.torch import load_file, save_file

    model = copy_model(good, tmp_path / "both")
    tensors = load_file(str(model / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(model / shard))
    _index({n: s for s, part in shards.items() for n in part})(model)
    (model / "model.safetensors").unlink()
    assert set(Checkpoint(model).tensors) == set(names)  # the shards alone: read
    (model / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    with pytest.raises(ExportError, match="model.safetensors.index.json") as e:
        Checkpoint(model)
    assert "transformers loads model.safetensors" in str(e.value)


def test_model_safetensors_is_read_alone_as_transformers_does(good: Path,
                                                              tmp_path: Path) -> None:
    """Beside model.safetensors (no index), another .safetensors file (a PEFT adapter saved in
    the same folder, a consolidated copy) is not read: transformers loads model.safetensors
    alone, and fuselm refused the folder (unused tensors, or each one stored twice)."""
    from safetensors.torch import save_file

    model = copy_model(good, tmp_path / "extra")
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 4)},
              str(model / "adapter_model.safetensors"))
    (model / "consolidated.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    ckpt = Checkpoint(model)
    assert set(ckpt.tensors) == set(Checkpoint(good).tensors)
    assert {t.file.name for t in ckpt.tensors.values()} == {"model.safetensors"}
