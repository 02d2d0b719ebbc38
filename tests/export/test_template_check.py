"""Convert renders the chat template on a few plain chats (one with a 31,500-character message)
under the run-time limits: a template that exceeds one, or crashes, is refused with one `error:`
line naming it, within the time limit, before any output exists; a template that refuses a
chat by its own raise_exception still converts (the chat's business at run time)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fuselm.export.tokenizer_check import check_tokenizer
from fuselm.runtime_metal.chat_template import DEFAULT_LIMITS, PROBE_CHATS
from tests.export.inputs import copy_model, error_line, run_cli
from tests.runtime.template_cases import CASES


@pytest.fixture(scope="module")
def good(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("qwen3")  # the session's tiny Qwen3 (tests/export/conftest.py)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_convert_refuses_a_template_over_its_limits(case: str, where: str, good: Path,
                                                    tmp_path: Path) -> None:
    template, needle = CASES[case]
    model = copy_model(good, tmp_path / "model")
    if where == "chat_template.jinja":
        (model / where).write_text(template)
    else:
        cfg = json.loads((model / where).read_text())
        (model / where).write_text(json.dumps({**cfg, "chat_template": template}))
    out = tmp_path / "out"
    t0 = time.monotonic()
    line = error_line(*run_cli("convert", str(model), "-o", str(out), "--quiet",
                               "--no-optimize"))
    # every probe chat at most once up to the limit, plus a worker start
    assert time.monotonic() - t0 < len(PROBE_CHATS) * DEFAULT_LIMITS.seconds + 30
    assert where in line and "chat template" in line and needle in line, line
    assert "fix the template or remove it" in line
    assert not out.exists()


def test_a_template_that_refuses_the_probe_chats_itself_converts(good: Path,
                                                                  tmp_path: Path) -> None:
    model = copy_model(good, tmp_path / "model")
    (model / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'tool' %}{{ raise_exception('tool chats only') }}{% endif %}")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    check_tokenizer(model, vocab)  # what convert runs on the tokenizer files: no error
