"""`convert --adapter`: a PEFT LoRA adapter merged by fuselm gives the logits and greedy tokens
PEFT's own PeftModel gives (float32), on both engines; bad adapters are one error line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fuselm.converter.models.builtin import build_model
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.cli_run import cli, one_error
from tests.export.helpers import assert_engines_match

PROMPT = [int(i) for i in np.random.default_rng(5).integers(3, 384, 24)]
STEPS = 32


def _adapter(base: Path, out: Path, seed: int, **lora: Any) -> tuple[Path, np.ndarray, list[int]]:
    """A random PEFT adapter over `base` (B not zero: init_lora_weights=False, and the trained
    extras perturbed), saved as PEFT saves it; with PeftModel's float32 logits and greedy
    tokens on PROMPT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if p.requires_grad and "lora_" not in name:  # modules_to_save, trained biases
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    peft.save_pretrained(out)
    peft.eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = peft(ids).logits[0].numpy()
        tokens = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    return out, logits, tokens


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # untied, q/k/v/o and MLP biases: every kind of tensor an adapter can touch
    return build_model(tmp_path_factory.mktemp("lora_base"), "llama", seed=11,
                       attention_bias=True, mlp_bias=True, tie_word_embeddings=False)


ADAPTERS = {
    "plain": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "rslora-patterns-extras": {
        "r": 8, "lora_alpha": 16, "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "lm_head"],
        "rank_pattern": {"layers.1.self_attn.k_proj": 2}, "alpha_pattern": {"o_proj": 3},
        "modules_to_save": ["post_attention_layernorm"], "bias": "lora_only"},
    "regex-all-bias": {"r": 2, "lora_alpha": 5, "target_modules": r".*\.mlp\.(gate|up)_proj",
                       "bias": "all"},
}


@pytest.mark.parametrize("case", list(ADAPTERS))
def test_merged_adapter_matches_peft(base: Path, tmp_path: Path, capsys, case: str) -> None:  # noqa: ANN001
    adapter, ref, ref_tokens = _adapter(base, tmp_path / "adapter", 3, **ADAPTERS[case])
    out = tmp_path / "out"
    code, err = cli(capsys, "convert", str(base), "-o", str(out), "--dtype", "float32",
                    "--adapter", str(adapter), "--quiet")
    assert code == 0, err
    record = json.loads((out / "fuselm.json").read_text())["source"]["adapter"]
    assert record["merged"] > 0 and record["path"] == str(adapter.resolve())
    assert_engines_match(out, PROMPT, ref, ref_tokens, STEPS)


def test_adapter_changes_the_model(base: Path, tmp_path: Path) -> None:
    """The comparison above means something: the merged model is not the base model."""
    from fuselm import convert

    _, ref, _ = _adapter(base, tmp_path / "adapter", 3, **ADAPTERS["plain"])
    plain = make_engine(convert(base, tmp_path / "base_out", dtype="float32"), "onnxruntime")
    assert rel(engine_logits(plain, PROMPT, 8), ref) > 1e-2
    merged = convert(base, tmp_path / "out", dtype="float32", adapter=tmp_path / "adapter")
    got = engine_logits(make_engine(merged, "onnxruntime", accuracy_level=0), PROMPT, 8)
    assert rel(got, ref) <= 1e-4


def test_adapter_is_merged_before_quantization(base: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """--quant q4 quantizes the merged weights: the same bytes as quantizing PEFT's own merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, _, _ = _adapter(base, tmp_path / "adapter", 3, **ADAPTERS["plain"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged_dir = tmp_path / "merged"
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(merged_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():
            shutil.copy(base / name, merged_dir / name)
    args = ["--dtype", "float32", "--quant", "q4", "--no-calibration", "--quiet"]
    assert cli(capsys, "convert", str(base), "-o", str(tmp_path / "a"), "--adapter",
               str(adapter), *args)[0] == 0
    assert cli(capsys, "convert", str(merged_dir), "-o", str(tmp_path / "b"), *args)[0] == 0
    a = make_engine(tmp_path / "a", "onnxruntime", accuracy_level=0)
    b = make_engine(tmp_path / "b", "onnxruntime", accuracy_level=0)
    assert rel(engine_logits(a, PROMPT, 8), engine_logits(b, PROMPT, 8)) <= 1e-3


def _edit_config(adapter: Path, **changes: Any) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(adapter: Path, edit: Any) -> None:
    from safetensors.numpy import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _rename(old: str, new: str) -> Any:
    def edit(t: dict[str, np.ndarray]) -> None:
        for k in [k for k in t if old in k]:
            t[k.replace(old, new)] = t.pop(k)
    return edit


def _drop_b(t: dict[str, np.ndarray]) -> None:
    del t[next(k for k in t if k.endswith("lora_B.weight"))]


def _wrong_rank(t: dict[str, np.ndarray]) -> None:
    k = next(k for k in t if k.endswith("lora_A.weight"))
    t[k] = np.concatenate([t[k], t[k][:1]])


BAD = {
    "no config": (lambda a: (a / "adapter_config.json").unlink(), "no adapter_config.json"),
    "no weights": (lambda a: (a / "adapter_model.safetensors").unlink(),
                   "no adapter_model.safetensors"),
    "pickle": (lambda a: ((a / "adapter_model.safetensors").unlink(),
                          (a / "adapter_model.bin").write_bytes(b"\x80\x04never loaded")),
               "adapter_model.bin, a pickle"),
    "dora": (lambda a: _edit_config(a, use_dora=True), "DoRA (use_dora)"),
    "not lora": (lambda a: _edit_config(a, peft_type="IA3"), "peft_type is 'IA3'"),
    "unknown key": (lambda a: _edit_config(a, fancy_option=3), "sets fancy_option"),
    "bad regex": (lambda a: _edit_config(a, target_modules="(q_proj"), "not a regular"),
    "rank": (lambda a: _edit_config(a, r=5), "rank 5"),
    "rank mismatch": (lambda a: _rewrite_tensors(a, _wrong_rank), "rank 4"),
    "missing B": (lambda a: _rewrite_tensors(a, _drop_b), "has no lora_B"),
    "unknown module": (lambda a: _rewrite_tensors(a, _rename("q_proj", "qq_proj")),
                       "which the base model"),
    "untargeted": (lambda a: _edit_config(a, target_modules=["q_proj", "v_proj"]),
                   "does not name"),
    "target absent": (lambda a: _edit_config(a, target_modules=["q_proj", "v_proj", "down_proj",
                                                                "w9"]), "names w9"),
}


@pytest.fixture(scope="module")
def good_adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _adapter(base, tmp_path_factory.mktemp("good") / "adapter", 3, **ADAPTERS["plain"])[0]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_one_error(base: Path, good_adapter: Path, tmp_path: Path, capsys,  # noqa: ANN001
                                  case: str) -> None:
    edit, words = BAD[case]
    adapter = tmp_path / "adapter"
    shutil.copytree(good_adapter, adapter)
    edit(adapter)
    out = tmp_path / "out"
    line = one_error(*cli(capsys, "convert", str(base), "-o", str(out), "--adapter",
                          str(adapter), "--quiet"))
    assert words in line, line
    assert not out.exists()


def test_adapter_for_another_base_is_refused(good_adapter: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    other = build_model(tmp_path / "other", "llama", seed=1, intermediate_size=80)
    capsys.readouterr()  # build_model's progress bar
    line = one_error(*cli(capsys, "convert", str(other), "-o", str(tmp_path / "out"),
                          "--adapter", str(good_adapter), "--quiet"))
    assert "down_proj" in line and "base-model mismatch" in line, line


def test_adapter_on_tied_head_is_refused(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    tied = build_model(tmp_path / "tied", "qwen3", seed=2)
    adapter, _, _ = _adapter(tied, tmp_path / "adapter", 1, r=2, lora_alpha=2,
                             target_modules=["q_proj", "lm_head"])
    capsys.readouterr()
    line = one_error(*cli(capsys, "convert", str(tied), "-o", str(tmp_path / "out"),
                          "--adapter", str(adapter), "--quiet"))
    assert "lm_head.weight" in line and "tied" in line, line


def test_adapter_over_a_gguf_is_refused(good_adapter: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from fuselm.converter.models.smollm2 import bundled_gguf

    line = one_error(*cli(capsys, "convert", str(bundled_gguf()), "-o", str(tmp_path / "out"),
                          "--adapter", str(good_adapter), "--quiet"))
    assert "GGUF file" in line and "--adapter" in line, line
    assert not (tmp_path / "out").exists()
