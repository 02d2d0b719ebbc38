"""Hostile GGUF files: metadata of the wrong type or nested past any use, duplicate or
overlapping tensors, a FIFO, a block count the tensors do not back. Each convert ends in one
`error:` line (exit 2), in seconds, with no output folder."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.export.gguf_files import gguf_value, nested_array, rewrite_gguf, write_gguf
from tests.export.inputs import error_line, run_cli

U32, I32, F32, STR, ARR = 4, 5, 6, 8, 9
A = "llama"  # the architecture prefix of the tiny file's keys


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_gguf(tmp_path_factory.mktemp("gguf-hostile") / "tiny.gguf", "llama", {},
                         seed=3)
    return path


def _dup(table: list) -> None:
    table.append(list(table[0]))


def _overlap(table: list) -> None:
    table[1][3] = table[0][3]  # the second tensor's data starts where the first one's does


# case -> (metadata replacements, tensor table edit, words the error line must hold)
CASES: dict[str, tuple[dict[str, bytes | None], Callable[[list], None] | None, list[str]]] = {
    "head_count string": ({f"{A}.attention.head_count": gguf_value(STR, "4")}, None,
                          ["attention.head_count is '4'", "an integer >= 1"]),
    "head_count array": ({f"{A}.attention.head_count": gguf_value(ARR, [4, 4], U32)}, None,
                         ["attention.head_count is an array of 2"]),
    "head_count 0": ({f"{A}.attention.head_count": gguf_value(U32, 0),
                      f"{A}.attention.key_length": None, f"{A}.rope.dimension_count": None},
                     None, ["attention.head_count is 0"]),
    "embedding_length float": ({f"{A}.embedding_length": gguf_value(F32, 64.5)}, None,
                               ["embedding_length is 64.5"]),
    "block_count negative": ({f"{A}.block_count": gguf_value(I32, -2)}, None,
                             ["block_count is -2"]),
    "context_length string": ({f"{A}.context_length": gguf_value(STR, "x")}, None,
                              ["context_length is 'x'"]),
    "freq_base array": ({f"{A}.rope.freq_base": gguf_value(ARR, [1.0], F32)}, None,
                        ["rope.freq_base is an array of 1", "a finite number > 0"]),
    "rms epsilon string": ({f"{A}.attention.layer_norm_rms_epsilon": gguf_value(STR, "x")},
                           None, ["layer_norm_rms_epsilon is 'x'"]),
    "architecture array": ({"general.architecture": gguf_value(ARR, ["llama"], STR)}, None,
                           ["general.architecture is an array of 1", "a string"]),
    "eos id array": ({"tokenizer.ggml.eos_token_id": gguf_value(ARR, [2], U32)}, None,
                     ["eos_token_id is an array of 1"]),
    "bos id beyond the vocabulary": ({"tokenizer.ggml.bos_token_id": gguf_value(U32, 10**6)},
                                     None, ["bos_token_id is 1000000", "below the vocabulary"]),
    "arrays nested 20,000 deep": ({"x.nested": nested_array(20000)}, None,
                                  ["not a valid GGUF", "nests more than"]),
    "head_count nested 20,000 deep": ({f"{A}.attention.head_count": nested_array(20000)}, None,
                                      ["nests more than"]),
    "duplicate tensor": ({}, _dup, ["listed twice"]),
    "overlapping tensor data": ({}, _overlap, ["overlap"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_gguf_refused(case: str, tiny_gguf: Path, tmp_path: Path) -> None:
    metadata, tensors, needles = CASES[case]
    bad = rewrite_gguf(tiny_gguf, tmp_path / "bad.gguf", metadata, tensors)
    out = tmp_path / "out"
    line = error_line(*run_cli("convert", str(bad), "-o", str(out), "--quiet"))
    for needle in needles:
        assert needle in line, line
    assert not out.exists()


def test_block_count_beyond_the_tensors_refused_before_building(tiny_gguf: Path,
                                                                tmp_path: Path) -> None:
    """1,000,000 blocks claimed over 2 stored: refused from the tensor table, in seconds (it
    used to size a million layers: gigabytes and minutes before the missing tensors)."""
    bad = rewrite_gguf(tiny_gguf, tmp_path / "big.gguf",
                       {f"{A}.block_count": gguf_value(U32, 1_000_000)})
    t0 = time.monotonic()
    line = error_line(*run_cli("convert", str(bad), "-o", str(tmp_path / "out"), "--quiet"))
    assert time.monotonic() - t0 < 30
    assert "block_count is 1000000" in line and "stores 2 decoder layer(s)" in line


def test_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    line = error_line(*run_cli("convert", str(fifo), "-o", str(tmp_path / "out")))
    assert "FIFO" in line and "not a regular file" in line


def test_file_round_trips_through_the_rewriter(tiny_gguf: Path, tmp_path: Path) -> None:
    """The surgery helper itself: no edit gives the same bytes (so every case above differs
    from a valid file only by its edit)."""
    copy: Any = rewrite_gguf(tiny_gguf, tmp_path / "copy.gguf")
    assert copy.read_bytes() == tiny_gguf.read_bytes()
