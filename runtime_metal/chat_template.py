"""Chat templates rendered with limits: the one place fuselm renders one.

run, chat, the Python API, serve and convert's check all render through `render_chat`. A chat
template is code from the model's files, run on every chat with the user's text; unbounded, two
nested `range(100000)` loops hang, `{{ 'x' * 10**9 }}` eats the machine's memory, and a template
quadratic in the message length holds whoever waits on it for a minute. So every render has:

- a time limit (TemplateLimits.seconds, 2 s): the render runs in a worker process
  (runtime_metal/template_sandbox.py), which is killed when its time is up. A process, not a
  thread: a thread cannot be stopped, and a template can spend its time inside one C call (a
  big `**`, `sort`, `str.replace`), where no check written in Python runs; a killed process also
  takes its memory with it. A warm worker costs one pipe round trip per render.
- a size limit on the output and on the values the template builds: a fixed allowance plus a
  multiple of the chat's own text, never above an absolute cap;
- a loop limit (total `{% for %}` iterations), checked inside the sandbox;
- recursion: Python's limit inside the worker, so a RecursionError is one error;
- memory: the worker's address space is capped where the OS enforces it (Linux).

Renders run outside any lock of the caller's: the server renders in a worker, then takes its
tokenizer lock only to encode the text, so one slow template never stalls other requests.
Everything the template sees is plain JSON data, as transformers gives it (its
`_plain_template_data`), so the worker renders exactly what `apply_chat_template` would.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fuselm.runtime_metal.errors import RuntimeUserError

WORKER_MODULE = "fuselm.runtime_metal.template_sandbox"
MAX_WORKERS = 8  # renders at once (more wait for a free worker: at most one time limit each)
IDLE_WORKERS = 4  # kept started between renders


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = 2.0
    loop_iterations: int = 1_000_000
    fixed_chars: int = 100_000  # a template's own text: headers, a default system prompt, tools
    chars_per_input_char: int = 4
    max_chars: int = 16_000_000

    def output_chars(self, input_chars: int) -> int:
        return min(self.max_chars, self.fixed_chars + self.chars_per_input_char * input_chars)


DEFAULT_LIMITS = TemplateLimits()


class ChatTemplateError(RuntimeUserError):
    """The chat template failed on a chat. `kind`: "syntax", "security" (a sandbox escape),
    "template" (the template's own raise_exception or an undefined value), "crash" (a Python
    error such as OverflowError) or "limit" (then `limit` names it: time, loop, size, memory,
    recursion)."""

    def __init__(self, message: str, kind: str, limit: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.limit = kind, limit


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, variables: Mapping[str, Any] | None = None,
                limits: TemplateLimits = DEFAULT_LIMITS,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The text `template` renders for `messages`, as transformers' apply_chat_template renders
    it (`variables`: the tokenizer's special tokens; `tools`: OpenAI function tools, which the
    template lays out for the model); ChatTemplateError if it fails or exceeds `limits`."""
    try:
        chat = [_message(m) for m in messages]
        context = {**_plain(dict(variables or {})), "messages": chat,
                   "tools": _plain(list(tools)) if tools else None,
                   "documents": None, "add_generation_prompt": add_generation_prompt}
        payload = json.dumps({"template": template, "context": context,
                              "max_chars": limits.output_chars(_text_size(context)),
                              "max_loops": limits.loop_iterations, "seconds": limits.seconds},
                             ensure_ascii=True, default=_placeholder)
    except RecursionError:
        raise ChatTemplateError("the chat's messages are nested too deeply to render",
                                "limit", "recursion") from None
    reply = _POOL.call(payload.encode() + b"\n", limits.seconds)
    if "text" in reply:
        return reply["text"]
    raise _error(reply, limits, context)


def start_workers(n: int = 2) -> None:
    """Start `n` idle workers now (a server at start-up: its first chats then find them warm, and
    a slow render leaves another one free)."""
    _POOL.start(n)


def tokenizer_template(tokenizer: Any) -> str | None:
    """The template transformers' apply_chat_template would use (None: the tokenizer has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.get_chat_template()
    except ValueError as e:  # named templates without a "default" one
        raise ChatTemplateError(f"the chat template cannot be chosen ({e})", "syntax") from None


def chat_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
              limits: TemplateLimits = DEFAULT_LIMITS,
              tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The tokenizer's chat template rendered for `messages` (and `tools`), with a generation
    prompt."""
    template = tokenizer_template(tokenizer)
    if template is None:
        raise ChatTemplateError("this model has no chat template", "template")
    return render_chat(template, messages, variables=tokenizer.special_tokens_map, limits=limits,
                       tools=tools)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered chat text, as apply_chat_template(tokenize=True) encodes it (the
    template wrote the special tokens itself)."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


# The chats convert renders a template with: the plainest one, a multi-turn one with a system
# prompt, and one long message (a template quadratic in a message's length shows itself here).
LONG_MESSAGE = "The quick brown fox jumps over the lazy dog. " * 700  # 31,500 characters
PROBE_CHATS = (
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": LONG_MESSAGE}],
)


def probe_template(template: str, variables: Mapping[str, Any] | None = None,
                   limits: TemplateLimits = DEFAULT_LIMITS) -> None:
    """Render the probe chats; raise ChatTemplateError unless each renders or is refused by the
    template itself (raise_exception, an undefined value: the chat's business at run time)."""
    for chat in PROBE_CHATS:
        try:
            render_chat(template, chat, variables=variables, limits=limits)
        except ChatTemplateError as e:
            if e.kind != "template":
                raise


_LIMIT_NAMES = {"loop": "loop limit", "size": "size limit", "memory": "memory limit",
                "recursion": "recursion limit", "time": "time limit"}


def _error(reply: dict[str, Any], limits: TemplateLimits, context: dict[str, Any]
           ) -> ChatTemplateError:
    kind, limit, name, text = reply["error"], reply.get("limit"), reply["type"], reply["message"]
    detail = f"{name}: {text}" if text else name
    if kind == "limit":
        what = _LIMIT_NAMES.get(limit or "", f"{limit} limit")
        if limit == "size":
            size = limits.output_chars(_text_size(context))
            what += (f" of {size:,} characters for this chat ({limits.fixed_chars:,} + "
                     f"{limits.chars_per_input_char} per character of the messages, at most "
                     f"{limits.max_chars:,})")
        elif limit == "loop":
            what += f" of {limits.loop_iterations:,} iterations"
        return ChatTemplateError(f"the chat template exceeded its {what}"
                                 + (f": {text}" if text else ""), kind, limit)
    if kind == "syntax":
        return ChatTemplateError(f"the chat template is not a valid Jinja template ({detail})",
                                 kind)
    if kind == "security":
        return ChatTemplateError(f"the chat template breaks out of Jinja's sandbox ({detail})",
                                 kind)
    if kind == "template":
        return ChatTemplateError(f"the chat template cannot be applied to this chat ({detail})",
                                 kind)
    return ChatTemplateError(f"the chat template failed ({detail})", kind)


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    """What transformers hands the template for one message: plain data, None-valued keys
    dropped, a reasoning field also under the names templates read it by."""
    if not isinstance(m, Mapping):
        raise ChatTemplateError(f"a chat message must be a mapping, not {type(m).__name__}",
                                "template")
    msg = {k: _plain(v) for k, v in m.items() if v is not None}
    reasoning = next((msg[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if msg.get(k) is not None), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def _plain(value: Any) -> Any:
    """Plain JSON data (transformers' `_plain_template_data`: other objects become a
    "<TypeName>" placeholder)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return _placeholder(value)


def _placeholder(value: Any) -> str:
    return f"<{type(value).__name__}>"


def _text_size(value: Any) -> int:
    """Characters of text in a JSON value (iterative: a deep value cannot recurse here)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


class _Worker:
    """One template_sandbox process, one request at a time, over its stdin/stdout."""

    def __init__(self) -> None:
        try:
            # -P: the working directory does not go first on the worker's sys.path, so a
            # folder named like a package there (a source checkout's fuselm/, a jinja2.py)
            # cannot shadow the installed one and kill the worker at import
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:  # start_new_session: a terminal's Ctrl-C does not reach it
            raise ChatTemplateError(f"cannot start the chat template renderer ({e})",
                                    "crash") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, payload: bytes, seconds: float) -> dict[str, Any] | None:
        """The reply, or None when the time ran out (the caller stops the worker). OSError
        when the worker is gone."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(payload)
        self.proc.stdin.flush()
        fd, buf = self.proc.stdout.fileno(), bytearray()
        ready = select.poll()  # not select(): a busy server's descriptors pass FD_SETSIZE
        ready.register(fd, select.POLLIN)
        deadline = time.monotonic() + seconds
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not ready.poll(left * 1000):
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise BrokenPipeError("the renderer exited")
            buf += chunk
        return json.loads(buf)

    def why_gone(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
        self.stop()  # closes the pipes, after their last words are read
        last = err.strip().splitlines()[-1] if err.strip() else ""
        return f"exit code {self.proc.returncode}" + (f": {last[:200]}" if last else "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


class _WorkerPool:
    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_WORKERS)

    def call(self, payload: bytes, seconds: float) -> dict[str, Any]:
        with self._slots:
            worker, fresh = self._take()
            try:
                try:
                    reply = worker.call(payload, seconds)
                except OSError:
                    if fresh:
                        raise
                    worker.stop()  # an idle worker that died meanwhile: once more, a new one
                    worker = _Worker()
                    reply = worker.call(payload, seconds)
            except OSError:
                raise ChatTemplateError(f"the chat template renderer stopped "
                                        f"({worker.why_gone()})", "crash") from None
            except BaseException:  # Ctrl-C mid-render: the worker's reply would be stale
                worker.stop()
                raise
            if reply is None:
                worker.stop()
                raise ChatTemplateError(
                    f"the chat template exceeded its time limit: it ran over {seconds:g} s",
                    "limit", "time")
            if reply.get("retire"):
                worker.stop()
            else:
                self._give_back(worker)
            return reply

    def start(self, n: int) -> None:
        with self._lock:
            missing = max(0, min(n, IDLE_WORKERS) - len(self._idle))
        for _ in range(missing):
            self._give_back(_Worker())

    def _take(self) -> tuple[_Worker, bool]:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker, False
                worker.stop()
        return _Worker(), True

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < IDLE_WORKERS:
                self._idle.append(worker)
                return
        worker.stop()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()


_POOL = _WorkerPool()
atexit.register(_POOL.close)
