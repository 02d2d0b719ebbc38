"""Chat templates rendered with limits (runtime_metal/chat_template.py): ordinary templates give
exactly transformers' apply_chat_template output; hostile ones end in one clean error within the
time limit, from the library, `fuselm run` and `fuselm chat`; a slow render stalls no other."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fuselm.runtime_metal.chat_template import (
    DEFAULT_LIMITS,
    ChatTemplateError,
    TemplateLimits,
    chat_ids,
    chat_text,
    render_chat,
)
from fuselm.runtime_metal.tokenizer import encode_prompt, load_tokenizer
from tests.cli_run import cli, one_error
from tests.runtime.template_cases import CASES, HOSTILE, LONG, TRIGGERS

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! What can I do?"},
     {"role": "user", "content": "naïve café — 3.14 <|im_start|> 🙂\n\ttabs"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "x" * 20_000}],
    [{"role": "user", "content": "think", "reasoning_content": "hmm", "name": None}],
]

# Exercises what the sandbox and the loop counter touch: loop variables (first, last, length,
# revindex, cycle), for-else, filtered and recursive loops, namespace, macros, the
# {% generation %} block (its `set` stays inside), dict(), tojson, slicing, special tokens.
RICH = """{{ bos_token }}{% set ns = namespace(last=-1, n=0) %}
{%- for m in messages[::-1] %}{% if m.role == 'user' and ns.last < 0 %}{% set ns.last =
 messages|length - loop.index0 - 1 %}{% endif %}{% endfor %}
{%- macro show(x) %}[{{ x|trim }}]{% endmacro %}
{%- for m in messages if m.content is defined %}
{{- loop.index }}/{{ loop.length }}:{{ loop.revindex }}{{ loop.cycle('a', 'b') }}
{%- if loop.first %}F{% endif %}{% if loop.last %}L{% endif %}
{%- if m.role == 'assistant' %}{% generation %}{% set hidden = 1 %}{{ show(m.content) }}
{%- endgeneration %}{% else %}{{ show(m.content) }}{% endif %}
{%- if m.reasoning_content is defined %}<think>{{ m.thinking }}</think>{% endif %}
{%- set ns.n = ns.n + 1 %}{% if loop.index0 == ns.last %}*{% endif %}
{%- else %}empty{% endfor %}
{{- hidden is defined }}{{ dict(a=1, b=[ns.n])|tojson }}
{%- for item in [{'k': 'x', 'c': [{'k': 'y', 'c': []}]}] recursive %}({{ item.k }}
{{- loop(item.c) }}){% endfor %}
{%- if add_generation_prompt %}{{ eos_token }}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tiny_tok(qwen3_artifact: Path) -> Any:
    return load_tokenizer(qwen3_artifact)


@pytest.fixture(scope="module")
def smol_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2-135M-Instruct's tokenizer files, as convert stages them from the bundled GGUF."""
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.export.gguf.source import GGUFCheckpoint, stage

    out = tmp_path_factory.mktemp("smol_tokenizer")
    stage(GGUFCheckpoint(bundled_gguf()), out)
    return load_tokenizer(out)


def _theirs(tok: Any, chat: list[dict[str, Any]], tokenize: bool) -> Any:
    out = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)
    return list(out["input_ids"]) if tokenize else out


@pytest.mark.parametrize("which", ["tiny", "smollm2", "rich"])
def test_ordinary_templates_render_as_transformers(which: str, tiny_tok: Any,
                                                   request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue("smol_tok") if which == "smollm2" else tiny_tok
    if which == "rich":
        tok = load_tokenizer(tok.name_or_path)  # a copy: the module's tokenizer stays as it is
        tok.chat_template = RICH
    for chat in CHATS:
        text = chat_text(tok, chat)
        assert text == _theirs(tok, chat, tokenize=False)
        assert chat_ids(tok, text) == _theirs(tok, chat, tokenize=True)
        if set(chat[-1]) == {"role", "content"}:  # what run/chat/the API pass for a prompt
            assert encode_prompt(tok, chat[-1]["content"], history=chat[:-1]) == \
                _theirs(tok, chat, tokenize=True)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_template_is_one_clean_error(case: str) -> None:
    template, needle = CASES[case]
    chat = [{"role": "user", "content": "x" * 30_000}]
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        render_chat(template, chat)
    took = time.monotonic() - t0
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert took < DEFAULT_LIMITS.seconds + 1.5, took  # the limit, a worker start, a kill
    assert render_chat("{{ messages[0].content|length }}", chat) == "30000"  # the pool recovers


def test_limits_are_set_per_render() -> None:
    loops = "{% for i in range(1000) %}{% for j in range(999) %}{% endfor %}{% endfor %}ok"
    assert render_chat(loops, []) == "ok"  # 1,000,000 iterations: at the limit
    with pytest.raises(ChatTemplateError, match="loop limit of 999,999"):
        render_chat(loops, [], limits=TemplateLimits(loop_iterations=999_999))
    echo = "{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}"
    big = [{"role": "user", "content": "y" * 4_000_000}]
    assert len(render_chat(echo, big)) == 8_000_000  # proportional to the chat: allowed
    with pytest.raises(ChatTemplateError, match="size limit of 1,000,000 characters"):
        render_chat(echo, big, limits=TemplateLimits(max_chars=1_000_000))
    with pytest.raises(ChatTemplateError, match="time limit: it ran over 0.3 s"):
        render_chat(CASES["quadratic in the message"][0], [{"role": "user", "content": "z" * 9000}],
                    limits=TemplateLimits(seconds=0.3))


def test_a_slow_render_stalls_no_other() -> None:
    slow_done = threading.Event()
    errors: list[str] = []

    def slow() -> None:
        try:
            render_chat(CASES["quadratic in the message"][0],
                        [{"role": "user", "content": "z" * 30_000}])
        except ChatTemplateError as e:
            errors.append(str(e))
        slow_done.set()

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.3)  # the slow one is rendering
    t0 = time.monotonic()
    out = render_chat(HOSTILE, [{"role": "user", "content": "quick"}])
    quick = time.monotonic() - t0
    assert not slow_done.is_set() and out.startswith("<|im_start|>user\nquick")
    thread.join(timeout=10)
    assert slow_done.is_set() and "time limit" in errors[0]
    assert quick < 1.5, quick


@pytest.fixture(scope="module")
def hostile_art(qwen3_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "art"
    shutil.copytree(qwen3_artifact, out)
    (out / "chat_template.jinja").write_text(HOSTILE)
    return out


RUN_CASES = {k: (k, needle) for k, (_, needle) in TRIGGERS.items()} | {
    "QUADRATIC": ("q" * (LONG + 20_000), "time limit")}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_run_refuses_with_one_error_line(capsys, hostile_art: Path, case: str) -> None:  # noqa: ANN001
    prompt, needle = RUN_CASES[case]
    line = one_error(*cli(capsys, "run", str(hostile_art), "--prompt", prompt, "-n", "2",
                          "--engine", "onnxruntime"))
    assert "chat template" in line and needle in line and "--raw" in line


def test_run_and_chat_still_answer_ordinary_messages(capsys, hostile_art: Path) -> None:  # noqa: ANN001
    from tests.ux.conftest import cli as ux_cli

    code, _ = cli(capsys, "run", str(hostile_art), "--prompt", "hello", "-n", "2",
                  "--engine", "onnxruntime")
    assert code == 0
    r = ux_cli("chat", str(hostile_art), "-n", "2", "--engine", "onnxruntime",
               input="LOOPS\nhello\n/history\n")
    assert r.returncode == 0, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "loop limit" in errors[0] and "Traceback" not in r.stderr
    assert "[user] hello" in r.stdout and "[user] LOOPS" not in r.stdout


def test_a_module_in_the_working_directory_cannot_shadow_the_renderer(tmp_path: Path) -> None:
    """The renderer process imports jinja2 and fuselm by their installed names: a jinja2.py in
    the folder a user runs fuselm from (or a source checkout's fuselm/) is not imported."""
    import subprocess
    import sys

    (tmp_path / "jinja2.py").write_text("raise ImportError('the shadowing jinja2.py')\n")
    code = ("from fuselm.runtime_metal.chat_template import render_chat; "
            "print(render_chat('[{{ messages[0].content }}]', [{'role': 'user', "
            "'content': 'hi'}]))")
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[hi]"
