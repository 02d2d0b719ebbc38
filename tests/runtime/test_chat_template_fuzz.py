"""Fuzzing chat templates (hypothesis): random templates built from fragments that loop, grow
strings and numbers, recurse, overflow, raise or break the syntax, on random chats (short,
non-ASCII, 30,000 characters). Every case must end in a rendered text or one ChatTemplateError
of one line, within the time limit (plus a worker start): never a hang, a traceback or the
machine's memory.

16 examples (FUSELM_FUZZ_EXAMPLES), a 0.5 s time limit so the cases that reach it stay cheap;
derandomized, so CI sees the same cases every run. `pytest -s` prints the outcomes."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuselm.runtime_metal.chat_template import ChatTemplateError, TemplateLimits, render_chat

LIMITS = TemplateLimits(seconds=0.5)
SLACK_S = 2.0  # a worker start (~0.2 s here) and a kill, on a loaded machine

NUMBERS = st.sampled_from(["0", "1", "7", "1000", "100000", "10**6", "10**9", "-1", "2**64"])
FRAGMENTS = [
    "{{ m.content }}",
    "{{ m.content * N }}",
    "{{ 'ab' * N }}",
    "{{ N ** N }}",
    "{{ (N * 1.5)|int }}",
    "{{ N|float * 1e308 }}",
    "{{ (10**N)|float }}",
    "{% for i in range(N) %}.{% endfor %}",
    "{% for i in range(N) %}{% for j in range(N) %}{% endfor %}{% endfor %}",
    "{% for c in m.content %}{% for d in m.content %}{% endfor %}{% endfor %}",
    "{{ m.content|center(N) }}",
    "{{ lipsum(N) }}",
    "{{ '%s'|format(N) }}",
    "{{ range(N)|list|length }}",
    "{{ (m.content ~ m.content)|unique|list|length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{{ f(N) }}",
    "{{ raise_exception('no ' ~ m.role) }}",
    "{{ 1 // (N - N) }}",
    "{{ m.content[N] }}{{ m.nothing.deeper }}",
    "{{ m|tojson(indent=N) }}",
    "{% if %}",
    "{{ ''.__class__ }}",
    "{{ bos_token }}{% generation %}{{ m.role }}{% endgeneration %}",
]
MACRO = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}x{% endmacro %}"
CONTENTS = st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * 30_000, "é🙂" * 500]))


@st.composite
def templates(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=3))
    body = "".join(p.replace("N", draw(NUMBERS)) for p in parts)
    return MACRO + "{% for m in messages %}" + body + "{% endfor %}"


@pytest.fixture(scope="module")
def outcomes() -> Iterator[Counter]:
    seen: Counter = Counter()
    yield seen
    print(f"\nchat template fuzz outcomes: {dict(seen)}")


@settings(max_examples=int(os.environ.get("FUSELM_FUZZ_EXAMPLES", "16")), deadline=None,
          derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(template=templates(),
       contents=st.lists(CONTENTS, min_size=1, max_size=3),
       roles=st.lists(st.sampled_from(["system", "user", "assistant", "tool"]), min_size=3,
                      max_size=3))
def test_fuzz_chat_template(outcomes: Counter, template: str, contents: list[str],
                            roles: list[str]) -> None:
    chat = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]
    t0 = time.monotonic()
    try:
        text = render_chat(template, chat, variables={"bos_token": "<s>"}, limits=LIMITS)
    except ChatTemplateError as e:
        assert str(e) and "\n" not in str(e)
        outcomes[f"error: {e.limit or e.kind}"] += 1
    else:
        assert isinstance(text, str)
        outcomes["rendered"] += 1
    assert time.monotonic() - t0 < LIMITS.seconds + SLACK_S
