"""`fuselm chat`: driven through a pseudo-terminal (readline, Ctrl-C) and through pipes."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.session import CachedSession
from fuselm.runtime_metal.tokenizer import encode_prompt, load_tokenizer
from tests.ux.conftest import FUSELM, cli


class Terminal:
    """A child process on a pseudo-terminal; reads everything it prints."""

    def __init__(self, *argv: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes the program
            # Ctrl-C must reach it as at a shell: pytest-xdist's workers ignore SIGINT, and an
            # ignored signal stays ignored across exec (Python then installs no handler).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(argv[0], list(argv))
        self.out = b""

    def read_until(self, marker: bytes, timeout: float = 120) -> bytes:
        end = time.monotonic() + timeout
        while marker not in self.out:
            left = end - time.monotonic()
            assert left > 0, f"timed out waiting for {marker!r}; got {self.out[-800:]!r}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                self.out += chunk
        assert marker in self.out, self.out[-800:]
        at = self.out.index(marker) + len(marker)
        seen, self.out = self.out[:at], self.out[at:]
        return seen

    def read_some(self, n: int, timeout: float = 120) -> None:
        """Wait until at least `n` more bytes have been printed (kept for read_until)."""
        end = time.monotonic() + timeout
        while len(self.out) < n:
            left = end - time.monotonic()
            assert left > 0, f"timed out waiting for {n} bytes; got {self.out[-800:]!r}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                self.out += os.read(self.fd, 4096)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> int:
        try:
            _, status = os.waitpid(self.pid, 0)
        finally:
            os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except ProcessLookupError:
            pass


def test_ctrl_c_mid_reply_keeps_the_session_and_history(artifact: Path) -> None:
    # -n 3000: a long reply; Ctrl-C goes as soon as it is streaming (a fixed sleep is not
    # enough: the lowered onnxruntime path writes 3,000 tokens of this tiny model in ~1 s).
    term = Terminal(FUSELM, "chat", str(artifact), "-n", "3000", "--engine", "onnxruntime")
    try:
        term.read_until(b">>> ")
        term.send(b"hello there\r")
        term.read_until(b"hello there")
        term.read_some(16)  # the echoed Enter, then the reply's first tokens
        term.send(b"\x03")
        term.read_until(b"[stopped]")
        term.read_until(b">>> ")  # the session goes on
        term.send(b"/history\r")
        shown = term.read_until(b">>> ")
        assert b"[user] hello there" in shown and b"[assistant]" in shown
        term.send(b"\x1b[A")  # up arrow: readline recalls the last line
        recalled = term.read_until(b"/history")
        assert b"^[[A" not in recalled
        term.send(b"\x15/quit\r")  # Ctrl-U clears the recalled line
        assert term.close() == 0
    finally:
        term.kill()


def test_slash_commands_are_answered_locally(artifact: Path) -> None:
    r = cli("chat", str(artifact), "-n", "4", "--engine", "onnxruntime",
            input="\n/help\n/frobnicate\n/system be brief\n/reset\ny\n/history\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "/system TEXT" in r.stdout  # /help
    assert "unknown command /frobnicate" in r.stdout
    assert "(system prompt set)" in r.stdout and "(conversation cleared)" in r.stdout
    assert "[system] be brief" in r.stdout  # the system prompt survives /reset


def test_cut_reply_is_marked(artifact: Path) -> None:
    r = cli("chat", str(artifact), "--max-tokens", "3", "--temp", "0", "--engine",
            "onnxruntime", input="hello\n")
    assert r.returncode == 0, r.stderr
    assert "[reply cut at 3 tokens" in r.stderr


def test_invalid_utf8_line_is_refused_and_the_session_continues(artifact: Path) -> None:
    r = cli("chat", str(artifact), "-n", "2", "--engine", "onnxruntime",
            input=b"caf\xe9 \xff\n/history\nhello\n/history\n")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "not valid UTF-8" in err and "Traceback" not in err
    assert b"[user] hello" in r.stdout


def test_closed_stdin_is_one_error_line(artifact: Path) -> None:
    r = subprocess.run(f"{FUSELM} chat {artifact} <&-", shell=True, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: stdin is closed"), r.stderr
    empty = cli("chat", str(artifact), input="")  # end of input at once: a clean exit
    assert empty.returncode == 0, empty.stderr


def test_no_tokenizer_error_names_no_chat_flag(artifact: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("model.onnx", "model.onnx.data", "fuselm.json"):
        (bare / f).symlink_to(artifact / f)
    r = cli("chat", str(bare), input="hi\n")
    assert r.returncode == 2 and "has no tokenizer" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "fuselm run --prompt-ids" in r.stderr


@pytest.mark.parametrize("engine", ["onnxruntime", "mlx"])
def test_second_turn_reuses_the_cache_and_matches_a_fresh_run(artifact: Path,
                                                              engine: str) -> None:
    tok = load_tokenizer(artifact)
    session = CachedSession(make_engine(artifact, engine))
    first = encode_prompt(tok, "hello there")
    r1 = session.stream(first, max_new_tokens=6)
    while True:
        try:
            next(r1)
        except StopIteration as done:
            reply = done.value
            break
    history = [{"role": "user", "content": "hello there"},
               {"role": "assistant", "content": tok.decode(reply.tokens,
                                                           skip_special_tokens=True)}]
    second = encode_prompt(tok, "and then?", history=history)
    gen = session.stream(second, max_new_tokens=6)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            cont = done.value
            break
    assert session.reused >= len(first)  # the first turn's prompt was not prefilled again
    assert cont.prompt_tokens == len(second) - session.reused
    fresh = generate(make_engine(artifact, engine), second, max_new_tokens=6)
    assert cont.tokens == fresh.tokens


def test_a_long_chat_drops_its_oldest_turns_by_the_rule(artifact: Path, capsys) -> None:  # noqa: ANN001
    """Past the window (--max-kv-tokens), each reply's prompt is the system prompt and the
    last turns that fit with a full reply (chat_window.py's rule, checked against trying every
    cut in order); what was dropped is said on stderr, and replies go on."""
    from fuselm.converter.cli.chat_cmd import Chat
    from fuselm.runtime_metal.loaded_model import open_model
    from fuselm.runtime_metal.sampling import SamplingOptions

    window, n = 160, 4
    model = open_model(artifact, "onnxruntime")
    tok = model.tokenizer
    gen = {"max_new_tokens": n, "sampling": SamplingOptions(), "context_length": window}
    chat = Chat(tok, model.session(), "you are terse", gen, window)
    dropped = 0
    for i in range(8):
        line = f"question {i}: the quick brown fox jumps over the lazy dog again"
        before = chat.turns
        # the rule, literally: drop 0, 1, 2, ... oldest turns until prompt + reply fits
        for drop in range(len(before) // 2 + 1):
            kept = before[2 * drop:]
            ids = encode_prompt(tok, line, history=[{"role": "system",
                                                     "content": "you are terse"}, *kept])
            if len(ids) + n <= window:
                break
        chat.reply(line)
        assert chat.turns[:-2] == kept and chat.turns[-2]["content"] == line
        err = capsys.readouterr().err
        if drop:
            dropped += 1
            assert f"[context: dropped the oldest {drop} turn(s) ({2 * drop} messages) to " \
                   f"fit {window} tokens" in err
        else:
            assert "dropped" not in err
    assert dropped >= 3  # the window was reached and the chat went on


def test_chat_memory_limit_sets_the_window(artifact: Path) -> None:
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.kv_budget import kv_token_bytes

    lines = "".join(f"tell me about fox number {i} and the lazy dog\n" for i in range(6))
    r = cli("chat", str(artifact), "-n", "4", "--temp", "0", "--engine", "onnxruntime",
            "--memory-limit", "0.0001", input=lines)
    assert r.returncode == 0, r.stderr
    window = int(0.0001e9 // kv_token_bytes(read_manifest(artifact), "onnxruntime"))
    assert "[context: dropped the oldest" in r.stderr and f"to fit {window} tokens" in r.stderr
    both = cli("chat", str(artifact), "--max-kv-tokens", "100", "--memory-limit", "1",
               input="hi\n")
    assert both.returncode == 2 and "not both" in both.stderr


def test_a_path_that_is_no_artifact_is_named_so(tmp_path: Path) -> None:
    """chat on a missing folder or a folder that is no model says that, as run does (not that
    a tokenizer is missing)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, says in ((tmp_path / "missing", "is not a directory"),
                       (empty, "is not a fuselm artifact")):
        r = cli("chat", str(path), input="hi\n")
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
        assert "tokenizer" not in r.stderr


def test_a_reply_cut_by_the_window_says_so(artifact: Path) -> None:
    """A reply that stops because the window is full (not at -n) names the window, not -n."""
    r = cli("chat", str(artifact), "-n", "200", "--temp", "0", "--engine", "onnxruntime",
            "--max-kv-tokens", "40", input="hello\n")
    assert r.returncode == 0, r.stderr
    cut = next(ln for ln in r.stderr.splitlines() if "[reply cut at" in ln)
    assert "raise -n" not in cut and "40-token window" in cut, cut


def test_piped_chat_writes_only_the_replies(artifact: Path) -> None:
    """`fuselm chat M < questions > answers`: no prompt marks (there is no one typing), each
    reply on stdout as `run` gives it; notices (a cut reply) go to stderr."""
    r = cli("chat", str(artifact), "-n", "4", "--temp", "0", "--engine", "onnxruntime",
            input="hello\n")
    assert r.returncode == 0, r.stderr
    one = cli("run", str(artifact), "-p", "hello", "-n", "4", "--temp", "0", "--engine",
              "onnxruntime", "--json")
    assert r.stdout == json.loads(one.stdout)["text"] + "\n", repr(r.stdout)
    assert "[reply cut at 4 tokens" in r.stderr


def test_a_message_longer_than_the_window_is_refused_and_the_chat_goes_on(
        artifact: Path) -> None:
    r = cli("chat", str(artifact), "-n", "2", "--temp", "0", "--engine", "onnxruntime",
            "--max-kv-tokens", "100", input="hello\n" + "word " * 200 + "\nhi\n/history\n")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("error: "))
    assert "100-token window" in line and "model's context" not in line, line
    # the refused message is not kept, and it cost the conversation nothing
    assert "[user] hello" in r.stdout and "[user] hi" in r.stdout
    assert "[user] word" not in r.stdout and "dropped" not in r.stderr
