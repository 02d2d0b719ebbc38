"""`fuselm chat`: an interactive conversation with a converted model.

Line editing and history come from Python's readline (through input()); Ctrl-C stops the
current reply only; the KV cache of earlier turns is reused (runtime_metal/session.py), so a
turn prefills only its new tokens. A conversation that outgrows the window (the model's context,
or --max-kv-tokens / --memory-limit) loses its oldest turns (runtime_metal/chat_window.py: the
system prompt and the last turns that fit are kept), said in one line on stderr.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fuselm.converter.cli.options import (
    accuracy_option,
    kv_cache_options,
    model_argument,
    threads_option,
)
from fuselm.converter.cli.run_cmd import (
    ENGINE_OPTION,
    JSON_SCHEMA_OPTION,
    open_artifact,
    reply_grammar,
    sampling_from,
    sampling_options,
)
from fuselm.runtime_metal.artifact import TOKENIZER_FILES, read_manifest
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.kv_budget import budget_tokens, kv_token_bytes

HELP = """commands:
  /help          this list
  /reset         forget the conversation (asks first)
  /system TEXT   set the system prompt (empty TEXT removes it)
  /history       show the conversation so far
  /quit, /exit   end the session (Ctrl-D too)
Ctrl-C stops the current reply; the conversation is kept. Up/down arrows recall earlier lines."""


def _enable_line_editing() -> None:
    """input() gains line editing and in-session history once readline is imported."""
    with contextlib.suppress(ImportError):  # e.g. Windows' Python has no readline
        import readline  # noqa: F401


def _read_line(prompt: str) -> str | None:
    """One user line; None at end of input. Ctrl-C on an empty prompt does not end the
    session (as in Python's own REPL)."""
    while True:
        try:
            return input(prompt)
        except EOFError:
            return None
        except KeyboardInterrupt:
            click.echo("\n(Ctrl-D or /quit ends the session)")


def _has_bad_bytes(line: str) -> bool:
    # stdin decodes with surrogateescape: undecodable bytes become lone surrogates U+DC80..DCFF
    return any("\udc80" <= c <= "\udcff" for c in line)


class Chat:
    """The conversation state: messages, system prompt, and the cached session. `window`: the
    tokens a prompt plus its reply may take (the conversation is cut to fit it)."""

    def __init__(self, tok: Any, session: Any, system: str | None, gen: dict[str, Any],
                 window: int, constraint: Callable[[], Any] | None = None) -> None:
        self.tok, self.session, self.gen = tok, session, gen  # gen: max_new_tokens, sampling
        self.window = window
        self.system = system
        self.turns: list[dict[str, str]] = []
        self.constraint = constraint  # a fresh grammar state per reply (--json-schema)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def command(self, line: str) -> bool:
        """Handle a slash command locally; False means quit."""
        name, _, arg = line.partition(" ")
        if name in ("/quit", "/exit", "/bye"):
            return False
        if name in ("/help", "/?"):
            click.echo(HELP)
        elif name == "/reset":
            answer = _read_line("forget the whole conversation? [y/N] ")
            if answer is not None and answer.strip().lower() in ("y", "yes"):
                self.turns = []
                self.session.reset()
                click.echo("(conversation cleared)")
            else:
                click.echo("(kept)")
        elif name == "/history":
            for m in self.messages():
                click.echo(f"[{m['role']}] {m['content']}")
        elif name == "/system":
            self.system = arg.strip() or None
            click.echo(f"(system prompt {'set' if self.system else 'removed'})")
        else:
            click.echo(f"unknown command {name}; /help lists the commands "
                       "(start a message with a space to send a leading slash)")
        return True

    def prompt(self, line: str) -> list[int] | None:
        """The conversation with `line` as token ids, its oldest turns dropped (for good) when
        it and a full reply (-n) do not fit the window; None (nothing dropped, said on stderr)
        when `line` and the system prompt alone leave no room for a reply."""
        from fuselm.runtime_metal.chat_window import fit
        from fuselm.runtime_metal.tokenizer import encode_prompt

        fitted = fit([*self.messages(), {"role": "user", "content": line}],
                     lambda m: encode_prompt(self.tok, m[-1]["content"], history=m[:-1]),
                     self.window, self.gen["max_new_tokens"])
        if len(fitted.tokens) >= self.window:  # fit kept only this turn, and it is too long
            click.echo(f"error: this message takes {len(fitted.tokens)} tokens with the system "
                       f"prompt, more than the {self.window}-token window; send a shorter one",
                       err=True)
            return None
        if fitted.dropped_messages:
            self.turns = self.turns[fitted.dropped_messages:]
            click.echo(f"[context: dropped the oldest {fitted.dropped_turns} turn(s) "
                       f"({fitted.dropped_messages} messages) to fit {self.window} tokens with "
                       "the reply; the system prompt and the later turns are kept]", err=True)
        return fitted.tokens

    def reply(self, line: str) -> None:
        ids = self.prompt(line)
        if ids is None:  # refused: the conversation stays as it was
            return
        pieces: list[str] = []
        shape = {"constraint": self.constraint()} if self.constraint else {}
        stream = self.session.stream(ids, **self.gen, **shape)
        try:
            while True:
                try:
                    piece = next(stream)
                except StopIteration as done:
                    result = done.value
                    break
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stream.close()
            click.echo(" [stopped]")
            self.turns += [{"role": "user", "content": line},
                           {"role": "assistant", "content": "".join(pieces)}]
            return
        sys.stdout.write("\n")
        # a notice, as the dropped-turns one: stderr, so that piped replies stay the replies
        if result.stop_reason == "length" and len(result.tokens) < self.gen["max_new_tokens"]:
            click.echo(f"[reply cut at {len(result.tokens)} tokens: the conversation filled the "
                       f"{self.window}-token window]", err=True)
        elif result.stop_reason == "length":
            click.echo(f"[reply cut at {len(result.tokens)} tokens; raise -n for longer replies]",
                       err=True)
        sys.stdout.flush()
        self.turns += [{"role": "user", "content": line},
                       {"role": "assistant", "content": result.text}]


@click.command("chat")
@model_argument
@click.option("-n", "--max-new-tokens", "--max-tokens", type=click.IntRange(1), default=256,
              show_default=True, help="tokens per reply at most")
@sampling_options
@ENGINE_OPTION
@accuracy_option
@threads_option
@kv_cache_options
@click.option("--system", default=None, help="system prompt")
@click.option("--max-kv-tokens", type=click.IntRange(2), default=None,
              help="KV cache budget in tokens: the window the conversation (with the reply) is "
              "cut to, oldest turns first  [default: the model's context]")
@click.option("--memory-limit", type=click.FloatRange(0, min_open=True), default=None,
              metavar="GB", help="the KV cache budget in GB (10^9 bytes) instead of tokens")
@JSON_SCHEMA_OPTION
def chat(out_dir: str, max_new_tokens: int, temperature: float | None, top_k: int | None,
         top_p: float | None, repetition_penalty: float | None, seed: int | None,
         engine: str, accuracy_level: int | None, threads: int | None,
         system: str | None,
         max_kv_tokens: int | None = None, memory_limit: float | None = None,
         min_p: float | None = None, presence_penalty: float | None = None,
         frequency_penalty: float | None = None, logit_bias: tuple[str, ...] = (),
         json_schema: str | None = None, kv_bits: str | None = None,
         kv_group_size: str | None = None) -> None:
    """Interactive chat with MODEL (history kept; /help lists the commands)."""
    if sys.stdin is None or sys.stdin.closed:
        raise RuntimeUserError("stdin is closed; chat reads your messages from stdin "
                               "(for one reply without stdin use `fuselm run --prompt TEXT`)")
    read_manifest(out_dir)  # a path that is no artifact is named so, before the tokenizer
    if not any((Path(out_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise RuntimeUserError(
            f"{out_dir} has no tokenizer, and chat needs one to turn text into tokens; "
            "re-convert from a checkpoint folder that has tokenizer.json "
            "(`fuselm run --prompt-ids` works without one)")
    sampling = sampling_from(out_dir, temperature, top_k, top_p, repetition_penalty, seed,
                             min_p, presence_penalty, frequency_penalty, logit_bias)
    grammar = reply_grammar(json_schema, False)
    model, _ = open_artifact(out_dir, engine, accuracy_level, threads=threads,
                             kv_bits=kv_bits, kv_group_size=kv_group_size)
    sampling.check_vocab(model.manifest.model.vocab_size)
    tok = model.tokenizer
    window = model.manifest.model.context_length
    budget = budget_tokens(max_kv_tokens, memory_limit,
                           kv_token_bytes(model.manifest, model.engine_name,
                                          int(kv_bits) if kv_bits else None,
                                          int(kv_group_size) if kv_group_size else None))
    if budget is not None:
        window = min(window, budget)
    gen = {"max_new_tokens": max_new_tokens, "sampling": sampling, "context_length": window}
    with contextlib.suppress(AttributeError, ValueError):  # not a reconfigurable text stream
        sys.stdin.reconfigure(errors="surrogateescape")  # type: ignore[union-attr]
    _enable_line_editing()
    state = Chat(tok, model.session(), system, gen, window,
                 (lambda: model.constraint(grammar)) if grammar else None)
    interactive = sys.stdin.isatty()  # piped (`chat M < questions`): no prompt marks
    if interactive:
        click.echo("chat with the model; /help lists the commands, Ctrl-D ends", err=True)
    while True:
        line = _read_line(">>> " if interactive else "")
        if line is None:
            if interactive:
                click.echo()  # end the prompt's line
            return
        if _has_bad_bytes(line):
            click.echo("that line is not valid UTF-8 text (check the terminal's encoding); "
                       "type it again", err=True)
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not state.command(line.strip()):
                return
            continue
        try:
            state.reply(line)
        except RuntimeUserError as e:  # e.g. the conversation outgrew the context
            click.echo(f"error: {e}; /reset starts over", err=True)
