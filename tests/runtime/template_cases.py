"""Hostile chat templates shared by the run, chat, convert and serve tests.

HOSTILE is one template that behaves like the tiny models' template (converter/models/builtin.py)
for ordinary messages and turns hostile on a trigger message: one artifact then serves every
case. CASES gives each trigger alone as its own template, for convert (which must refuse it)."""

from __future__ import annotations

# trigger message -> (template body, what the one error line must name)
TRIGGERS: dict[str, tuple[str, str]] = {
    "LOOPS": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
              "loop limit"),
    "BIG": ("{{ 'x' * 10**9 }}", "size limit"),
    "RECURSE": ("{{ f(0) }}", "recursion limit"),
    "OVERFLOW": ("{{ (10**400)|float }}", "OverflowError"),
    "OUTPUT": ("{% for i in range(100000) %}{{ 'abcdefghij' }}{% endfor %}", "size limit"),
}
MACROS = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}"
# Quadratic in the message's length: ~50 s for 30,000 characters, instant for a short one.
QUADRATIC = ("{% for i in range(m.content|length) %}{% set n = (m.content[i:]|unique|list)|length "
             "%}{% endfor %}")
LONG = 10_000  # messages longer than this take the quadratic branch

NORMAL = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
END = "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def _branches() -> str:
    out = "".join(f"{'if' if i == 0 else 'elif'} m.content == '{k}' %}}{body}{{% "
                  for i, (k, (body, _)) in enumerate(TRIGGERS.items()))
    return "{% " + out + f"elif m.content|length > {LONG} %}}{QUADRATIC}{{% else %}}{NORMAL}" \
        "{% endif %}"


HOSTILE = MACROS + "{% for m in messages %}" + _branches() + END

# Each case alone, for convert's check: (template, what the error line must name).
CASES: dict[str, tuple[str, str]] = {
    "nested loops": (TRIGGERS["LOOPS"][0], "loop limit"),
    "string multiplication": (TRIGGERS["BIG"][0], "size limit"),
    "recursion": (MACROS + TRIGGERS["RECURSE"][0], "recursion limit"),
    "OverflowError": (TRIGGERS["OVERFLOW"][0], "OverflowError"),
    "output size": (TRIGGERS["OUTPUT"][0], "size limit"),
    "quadratic in the message": ("{% for m in messages %}" + QUADRATIC + END, "time limit"),
}
