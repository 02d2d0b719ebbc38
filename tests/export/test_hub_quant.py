"""AWQ / GPTQ checkpoints (written here by the published packing rules: tests/export/
hub_quant_files.py) imported exactly: logits and greedy tokens equal HF transformers float32
on the dequantized weights, on both engines; unpacking checked against hand-made words; layouts
fuselm does not import refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.export.quantized.packing import awq_blocks, gptq_blocks, nibbles
from fuselm.runtime_metal.validate import engine_logits, hf_greedy, hf_logits, hf_model, rel
from tests.cli_run import cli, one_error, run_cli
from tests.export.helpers import assert_engines_match, exact_engines
from tests.export.hub_quant_files import pack_awq, pack_gptq, quantize, write_pair

PROMPT = [int(i) for i in np.random.default_rng(8).integers(3, 384, 24)]
STEPS = 32


def test_nibble_order_of_each_format() -> None:
    """One word per format, by hand: column / row c holding the value c."""
    awq = pack_awq(np.arange(8)[None].repeat(8, 0).T, np.ones((8, 1), np.float16),
                   np.zeros((8, 1), np.int64))
    # nibble i: column [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert awq["qweight"].view(np.uint32)[0, 0] == 0x75316420
    gptq = pack_gptq(np.arange(8)[None].repeat(8, 0), np.ones((8, 1), np.float16),
                     np.full((8, 1), 8), 8, v1=True)
    assert gptq["qweight"].view(np.uint32)[0, 0] == 0x76543210  # nibble i: input row i
    assert gptq["qzeros"].view(np.uint32)[0, 0] == 0x77777777  # v1: 8 stored as 7
    assert list(nibbles(np.array([0x76543210], np.uint32).view(np.int32))) == list(range(8))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_blocks_read_back_exactly(group: int) -> None:
    rng = np.random.default_rng(group)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    for sym in (False, True):
        q, s, z = quantize(w, group, sym, rng)
        awq = awq_blocks(**pack_awq(q, s, z), group=group)
        for v1 in (True, False):
            parts = pack_gptq(q, s, z, group, v1)
            gptq = gptq_blocks(parts["qweight"], parts["qzeros"], parts["scales"], group, v1)
            for got in (awq, gptq):
                assert np.array_equal(got.codes, q) and np.array_equal(got.zero_points, z)
                assert np.array_equal(got.scales, s.astype(np.float32))
                assert got.block_size == group and got.bits == 4


@pytest.fixture(scope="module")
def float_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # every K (128, 256) a whole number of groups of 128; untied, q/k/v biases
    return build_model(tmp_path_factory.mktemp("hubq"), "llama", seed=21, hidden_size=128,
                       intermediate_size=256, head_dim=32, attention_bias=True,
                       tie_word_embeddings=False)


CASES = {
    "awq-g128": dict(method="awq", group=128),
    "awq-g32-side-file": dict(method="awq", group=32, side_file=True),
    "gptq-v1-sym-g128": dict(method="gptq", group=128, sym=True),
    "gptq-v1-asym-g64": dict(method="gptq", group=64),
    "gptq-v1-asym-g32-side-file": dict(method="gptq", group=32, side_file=True),
    "gptq-v2-asym-g64": dict(method="gptq", group=64, fmt="gptq_v2"),
    "gptq-v1-asym-g128-lm-head": dict(method="gptq", group=128, lm_head=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_imported_checkpoint_matches_its_dequantized_model(float_model: Path, tmp_path: Path,
                                                           capsys, case: str) -> None:  # noqa: ANN001
    qdir, ref_dir = write_pair(float_model, tmp_path, **CASES[case])
    ref_model = hf_model(ref_dir)
    ref, ref_tokens = hf_logits(ref_model, PROMPT), hf_greedy(ref_model, PROMPT, STEPS)
    method = CASES[case]["method"]
    out = tmp_path / "out"
    code, err = cli(capsys, "convert", str(qdir), "-o", str(out), "--dtype", "float32",
                    "--quiet")
    assert code == 0, err
    manifest = json.loads((out / "fuselm.json").read_text())
    assert manifest["source"]["quantized"]["method"] == method
    # every projection kept as the checkpoint gives it (q/k/v and gate/up packed), none
    # quantized again; the float LM head and embeddings left float
    given = manifest["quantization"]["given"]
    head = CASES[case].get("lm_head", False)
    assert given == {"kept": {method: 4 * 2 + head}, "quantized": 0}, given
    assert manifest["quantization"]["lm_head"] == head
    assert not manifest["quantization"]["embeddings"]
    _assert_matches(out, ref, ref_tokens)


def test_quant_none_gives_the_dequantized_floats(float_model: Path, tmp_path: Path,
                                                 capsys) -> None:  # noqa: ANN001
    qdir, ref_dir = write_pair(float_model, tmp_path, "gptq", 32, seed=4)
    ref_model = hf_model(ref_dir)
    out = tmp_path / "out"
    code, err = cli(capsys, "convert", str(qdir), "-o", str(out), "--dtype", "float32",
                    "--quant", "none", "--quiet")
    assert code == 0, err
    assert json.loads((out / "fuselm.json").read_text())["quantization"] is None
    _assert_matches(out, hf_logits(ref_model, PROMPT), hf_greedy(ref_model, PROMPT, STEPS))


def _assert_matches(out: Path, ref: np.ndarray, ref_tokens: list[int]) -> None:
    assert_engines_match(out, PROMPT, ref, ref_tokens, STEPS)


def _edit_config(qdir: Path, **changes: object) -> None:
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (qdir / "config.json").write_text(json.dumps(cfg))


def _act_order(qdir: Path) -> None:
    from safetensors.numpy import load_file, save_file

    t = load_file(qdir / "model.safetensors")
    name = next(k for k in t if k.endswith("g_idx"))
    t[name] = np.random.default_rng(0).permutation(t[name])
    save_file(t, qdir / "model.safetensors")
    _edit_config(qdir, desc_act=True)


def _drop(part: str):  # noqa: ANN202
    def edit(qdir: Path) -> None:
        from safetensors.numpy import load_file, save_file

        t = load_file(qdir / "model.safetensors")
        del t[next(k for k in t if k.endswith(part))]
        save_file(t, qdir / "model.safetensors")
    return edit


BAD = {
    "act-order": ("gptq", _act_order, "act-order (desc_act"),
    "3 bits": ("gptq", lambda d: _edit_config(d, bits=3), "has bits 3"),
    "group 256": ("awq", lambda d: _edit_config(d, group_size=256), "has group_size 256"),
    "gemv": ("awq", lambda d: _edit_config(d, version="gemv"), "has version 'gemv'"),
    "no zero point": ("awq", lambda d: _edit_config(d, zero_point=False), "zero_point false"),
    "bitsandbytes": ("gptq", lambda d: _edit_config(d, quant_method="bitsandbytes"),
                     "quant_method 'bitsandbytes'"),
    "format": ("gptq", lambda d: _edit_config(d, checkpoint_format="marlin"),
               "checkpoint_format 'marlin'"),
    "group mismatch": ("gptq", lambda d: _edit_config(d, group_size=64), "do not fit"),
    "no qzeros": ("awq", _drop(".qzeros"), "has no qzeros"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_layouts_fuselm_does_not_import_are_refused(float_model: Path, tmp_path: Path, capsys,  # noqa: ANN001
                                                    case: str) -> None:
    method, edit, words = BAD[case]
    qdir, _ = write_pair(float_model, tmp_path, method, 128)
    edit(qdir)
    out = tmp_path / "out"
    line = one_error(*cli(capsys, "convert", str(qdir), "-o", str(out), "--quiet"))
    assert words in line, line
    assert not out.exists()


def test_adapter_on_a_quantized_checkpoint_is_refused(float_model: Path, tmp_path: Path,
                                                      capsys) -> None:  # noqa: ANN001
    qdir, _ = write_pair(float_model, tmp_path, "gptq", 128)
    (tmp_path / "adapter").mkdir()
    line = one_error(*cli(capsys, "convert", str(qdir), "-o", str(tmp_path / "out"),
                          "--adapter", str(tmp_path / "adapter"), "--quiet"))
    assert "--adapter merges into float weights" in line and "GPTQ" in line, line


def test_float16_graph_keeps_the_scales_exactly(float_model: Path, tmp_path: Path,
                                                capsys) -> None:  # noqa: ANN001
    """The checkpoint's own dtype (float16): its float16 scales stored as they are; logits
    within float16 rounding of the dequantized model's."""
    qdir, ref_dir = write_pair(float_model, tmp_path, "awq", 64, seed=5)
    out = tmp_path / "out"
    code, err = cli(capsys, "convert", str(qdir), "-o", str(out), "--quiet")
    assert code == 0, err
    manifest = json.loads((out / "fuselm.json").read_text())
    assert manifest["dtype"] == "float16" and manifest["quantization"]["given"]["quantized"] == 0
    ref = hf_logits(hf_model(ref_dir), PROMPT)
    for engine in exact_engines(out):
        assert rel(engine_logits(engine, PROMPT, 8), ref) <= 2e-2, engine.name


def test_quant_q4_keeps_the_blocks_and_quantizes_the_head(float_model: Path,
                                                          tmp_path: Path) -> None:
    from fuselm import convert

    qdir, _ = write_pair(float_model, tmp_path, "awq", 128, seed=6)
    out = convert(qdir, tmp_path / "out", quant="q4", dtype="float32", default_calibration=False)
    record = json.loads((out / "fuselm.json").read_text())["quantization"]
    assert record["given"] == {"kept": {"awq": 8}, "quantized": 1} and record["lm_head"]


def test_validate_measures_against_the_dequantized_weights(float_model: Path, tmp_path: Path,
                                                           capsys) -> None:  # noqa: ANN001
    """`fuselm validate` on an AWQ / GPTQ folder (which transformers runs only with
    gptqmodel's kernels): the reference is its dequantized weights in float32."""


    qdir, _ = write_pair(float_model, tmp_path, "gptq", 64, seed=7)
    out = tmp_path / "out"
    assert cli(capsys, "convert", str(qdir), "-o", str(out), "--dtype", "float32",
               "--quiet")[0] == 0
    code, stdout, _ = run_cli(capsys, "validate", str(qdir), str(out), "-n", "16", "--no-ppl",
                              "--json")
    assert code == 0
    report = json.loads(stdout)
    (rung,) = report["rungs"][1:]
    assert max(rung["logits_rel_hf"]) <= 1e-4 and set(rung["greedy_agree"]) == {16}, rung


def test_act_order_is_refused_by_default_and_read_dequantized_on_request(
        float_model: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """GPTQ act-order: no blocks fuselm can keep, so the default (keep the blocks) is refused by
    name; --quant none reads each weight as (q - z[g_idx]) * s[g_idx] exactly, --quant q4
    quantizes those values again."""
    qdir, ref_dir = write_pair(float_model, tmp_path, "gptq", 32, act_order=True, seed=9)
    line = one_error(*cli(capsys, "convert", str(qdir), "-o", str(tmp_path / "kept"),
                          "--quiet"))
    assert "act-order (desc_act" in line and "--quant none" in line, line
    ref_model = hf_model(ref_dir)
    out = tmp_path / "float"
    code, err = cli(capsys, "convert", str(qdir), "-o", str(out), "--dtype", "float32",
                    "--quant", "none", "--quiet")
    assert code == 0, err
    source = json.loads((out / "fuselm.json").read_text())["source"]
    assert source["quantized"]["act_order_layers"] == 7 * 2
    _assert_matches(out, hf_logits(ref_model, PROMPT), hf_greedy(ref_model, PROMPT, STEPS))
    code, err = cli(capsys, "convert", str(qdir), "-o", str(tmp_path / "q4"), "--quant", "q4",
                    "--no-calibration", "--quiet")
    assert code == 0, err
    record = json.loads((tmp_path / "q4" / "fuselm.json").read_text())["quantization"]
    assert record["given"] is None and record["bits"] == 4
