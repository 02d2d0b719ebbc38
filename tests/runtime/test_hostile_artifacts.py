"""Artifacts and options that used to run silently wrong, hang or end in a traceback: a graph
edited after conversion, a vocab_size beyond the graph's, fuselm.json nested past any use or
a FIFO, empty --prompt-ids entries, thread counts and bench lengths past what the host or the
model has. Each ends in one error line (exit 2), or for click's own range check its usage
error (exit 2) naming the option and the range."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from fuselm.converter.cli.options import MAX_THREADS
from fuselm.runtime_metal.perplexity import perplexity_of
from tests.cli_run import cli, one_error
from tests.runtime.conftest import edit_manifest


def _run(capsys: pytest.CaptureFixture, art: Path, *args: str) -> tuple[int, str]:
    return cli(capsys, "run", str(art), "--prompt-ids", "1,2", "-n", "2",
               "--engine", "onnxruntime", *args)


def test_graph_edited_after_conversion_refused(capsys, art: Path, family_models) -> None:  # noqa: ANN001
    """A node appended to model.onnx (logits squared) used to run without a word."""
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    out = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [o + "_pre" if o == out else o for o in node.output]
    model.graph.node.append(onnx.helper.make_node("Mul", [out + "_pre", out + "_pre"], [out]))
    onnx.save(model, str(art / "model.onnx"))
    line = one_error(*_run(capsys, art))
    assert "model.onnx is not the graph" in line and "SHA-256" in line
    hf_dir = family_models["qwen3"][0]
    for command in (["validate", str(hf_dir), str(art), "-n", "2", "--no-ppl"],
                    ["perplexity", str(art)]):
        assert "not the graph" in one_error(*cli(capsys, *command))


def test_artifact_without_recorded_hashes_still_loads(capsys, art: Path) -> None:  # noqa: ANN001
    """An artifact from before hashes were recorded has nothing to compare: it runs."""
    edit_manifest(art, lambda m: m.pop("integrity"))
    code, err = _run(capsys, art)
    assert code == 0, err


def test_vocab_size_beyond_the_graph_refused_at_load(capsys, art: Path) -> None:  # noqa: ANN001
    """vocab_size 100000 over a 384-entry graph let id 50000 reach onnxruntime's Gather."""
    edit_manifest(art, lambda m: m["model"].update(vocab_size=100000))
    line = one_error(*cli(capsys, "run", str(art), "--prompt-ids", "1,2,50000", "-n", "2",
                          "--engine", "onnxruntime"))
    assert "vocab_size = 100000" in line and "384" in line


def test_nested_manifest_refused(capsys, art: Path) -> None:  # noqa: ANN001
    (art / "fuselm.json").write_text("[" * 100000 + "]" * 100000)
    line = one_error(*_run(capsys, art))
    assert "fuselm.json is not valid JSON" in line and "nested deeper than 64" in line


def test_fifo_manifest_refused_not_waited_on(capsys, art: Path) -> None:  # noqa: ANN001
    (art / "fuselm.json").unlink()
    os.mkfifo(art / "fuselm.json")
    line = one_error(*_run(capsys, art))
    assert "fuselm.json is a FIFO" in line


@pytest.mark.parametrize("ids", ["1,,2", ",1", "1,2,", " "])
def test_prompt_ids_empty_entry_refused(capsys, qwen3_artifact: Path, ids: str) -> None:  # noqa: ANN001
    line = one_error(*cli(capsys, "run", str(qwen3_artifact), "--prompt-ids", ids))
    assert "--prompt-ids" in line and ("empty entry" in line or "is empty" in line)


@pytest.mark.parametrize("command", [["run", "--prompt-ids", "1,2"],
                                     ["bench", "-p", "8", "-n", "2", "-r", "1"],
                                     ["perplexity"], ["chat"]])
def test_threads_bounded_by_the_host(capsys, qwen3_artifact: Path, command: list[str]) -> None:  # noqa: ANN001
    code, err = cli(capsys, command[0], str(qwen3_artifact), *command[1:], "--engine",
                    "onnxruntime", "-t", "100000")
    assert code == 2 and "--threads" in err and f"1<=x<={MAX_THREADS}" in err, err


@pytest.mark.parametrize(("p", "n"), [("100000", "2"), ("8", "100000"), ("511", "2"),
                                      ("8,100000", "2")])
def test_bench_lengths_bounded_by_the_context(capsys, qwen3_artifact: Path, p: str,  # noqa: ANN001
                                              n: str) -> None:
    line = one_error(*cli(capsys, "bench", str(qwen3_artifact), "-p", p, "-n", n, "-r", "1",
                          "--engine", "onnxruntime"))
    assert "the model's context is 512" in line


def test_bench_list_with_an_empty_entry_refused(capsys, qwen3_artifact: Path) -> None:  # noqa: ANN001
    code, err = cli(capsys, "bench", str(qwen3_artifact), "-p", "8,,16")
    assert code == 2 and "comma-separated integers" in err


def test_infinite_perplexity_is_a_result() -> None:
    """A graph whose logits blow up (mean NLL past ~709) used to end in OverflowError."""
    def huge(ids: list[int]) -> np.ndarray:
        logits = np.zeros((len(ids), 8), np.float32)
        logits[:, 0] = 1e6  # every target but 0 gets NLL 1e6
        return logits

    result = perplexity_of(huge, [1, 2, 3, 4] * 4, context=8)
    assert math.isinf(result.ppl)


def test_validate_tokens_bounded_by_the_context(capsys, family_models) -> None:  # noqa: ANN001
    """validate -n 10**9 used to run HF's greedy loop on forever."""
    hf_dir, out = family_models["qwen3"]
    line = one_error(*cli(capsys, "validate", str(hf_dir), str(out), "-n", str(10**9),
                          "--no-ppl"))
    assert "the model's context is 512" in line


@pytest.mark.parametrize(("command", "option"), [
    (["serve", "--max-batch", str(10**9)], "--max-batch"),
    (["quant-report", "--top", "-3"], "--top"),
])
def test_count_options_bounded(capsys, qwen3_artifact: Path, command: list[str],  # noqa: ANN001
                               option: str) -> None:
    code, err = cli(capsys, command[0], str(qwen3_artifact), *command[1:])
    assert code == 2 and option in err and "is not in the range" in err, err
