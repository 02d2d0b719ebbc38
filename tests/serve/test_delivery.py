"""Token delivery off the engine thread (scheduler.py, delivery.py): a client that reads slowly
gets its text coalesced without slowing another stream, and the real SmolLM2-135M Q4 served
on onnxruntime's batched rows streams what `fuselm run` prints for the same greedy request,
two streams at once. Servers are started by the tests on 127.0.0.1 and stopped by PID."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from click.testing import CliRunner

from fuselm.converter.cli.main import cli
from tests.serve.conftest import MODEL, Server

N = 120


def _request(model: str, prompt: str, n: int) -> bytes:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n" + body)


def _texts(raw: bytes) -> list[str]:
    """The text of each SSE chunk of a raw (chunked) HTTP response."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            out.append(json.loads(line[6:])["choices"][0]["text"])
    return out


def _stream(srv: Server, prompt: str, n: int) -> tuple[str, float]:
    """A normal client: the streamed text and the seconds it took."""
    t = time.monotonic()
    c = srv.client()
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True))
    return text, time.monotonic() - t


def test_a_slow_reader_does_not_slow_another_stream(server: Server) -> None:
    """One client with a tiny receive buffer reads 32 bytes every 30 ms; a normal stream run
    next to it finishes within its solo time (plus slack), before the slow one; the slow one
    still gets its whole text, in fewer chunks than tokens."""
    solo_text, solo_s = _stream(server, "slow readers 1", N)
    slow_solo, _ = _stream(server, "slow readers 2", N)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.settimeout(60)
    host, port = server.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    sock.sendall(_request(MODEL, "slow readers 2", N))
    got = bytearray()
    slow_done = threading.Event()

    def read_slowly() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            part = sock.recv(32)
            if not part:
                break
            got.extend(part)
            time.sleep(0.03)
        slow_done.set()

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    try:
        time.sleep(0.5)  # the slow stream is under way
        text, seconds = _stream(server, "slow readers 1", N)
        assert text == solo_text
        assert seconds < 3 * solo_s + 5
        assert not slow_done.is_set()  # the normal stream did not wait for the slow one
        reader.join(timeout=130)
        assert slow_done.is_set()
    finally:
        sock.close()
    chunks = _texts(bytes(got))
    assert "".join(chunks) == slow_solo
    assert len(chunks) < N  # coalesced: the tokens that waited went out together


def test_smollm2_run_and_serve_stream_the_same_text(smol_server: Server) -> None:
    """Two greedy chat requests streamed at once (decoded in one batched step) get exactly the
    text `fuselm run --temperature 0` prints for each."""
    srv = smol_server
    assert srv.health()["engine"]["batch"]["mode"] == "rows"
    prompts = ["What is the capital of France?", "Name three colors and explain why."]
    want = []
    for p in prompts:
        res = CliRunner().invoke(cli, ["run", str(srv.out_dir), "--prompt", p, "-n", "48",
                                       "--temperature", "0", "--engine", "onnxruntime",
                                       "--accuracy-level", "0", "--json"])
        assert res.exit_code == 0, res.output
        want.append(json.loads(res.stdout.strip().splitlines()[-1])["text"])
    got: list[str] = ["", ""]

    def one(i: int) -> None:
        chunks = srv.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=48,
            temperature=0, stream=True)
        got[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(w.strip() for w in want)
    assert got == want
    assert Path(srv.log).exists()


def test_a_client_that_leaves_frees_its_row_at_once(smol_server: Server) -> None:
    """A streaming client killed mid-stream: its row is dropped within a few steps (the engine
    checks before each step), not decoded on to its 400 tokens, and the next request runs."""
    srv = smol_server
    client = textwrap.dedent(f"""
        import openai
        c = openai.OpenAI(base_url={srv.url + '/v1'!r}, api_key="none", max_retries=0)
        s = c.chat.completions.create(model={MODEL!r}, max_tokens=400, temperature=0,
            messages=[{{"role": "user", "content": "Tell me a very long story."}}], stream=True)
        for chunk in s:
            print("chunk", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE)
    try:
        for _ in range(4):  # it is streaming
            assert proc.stdout.readline() == b"chunk\n"  # type: ignore[union-attr]
        before = srv.health()["generated_tokens"]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while (h := srv.health())["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h["active"] == 0
    assert h["generated_tokens"] - before <= 16
    reply = srv.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


def _content_stops(reply: str, stop: list[str], truncated: bool = False) -> tuple[str, bool]:
    """`reply` through ContentStops (Qwen's <tool_call> format, one function "f"), a character
    a token: the text handed out, and whether a stop string ended it."""
    from fuselm.converter.serve.delivery import ContentStops
    from fuselm.runtime_metal.tool_calls import FORMATS

    hermes = next(f for f in FORMATS if f.name == "hermes")
    text = ContentStops(lambda ids: "".join(map(chr, ids)), stop, hermes, ["f"])
    out = "".join(text.push(ord(c)) for c in reply if not text.stopped)
    return out + text.finish(truncated), text.stopped


def test_stop_strings_apply_to_content_not_to_a_call() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"stop": 1}}\n</tool_call>'
    # in the content before a call: cut there, as without tools
    assert _content_stops("Sure, stop. " + call, ["stop"]) == ("Sure, ", True)
    # inside the call: the call is handed out whole (the server parses it into tool_calls)
    assert _content_stops("Sure. " + call, ["stop", "call>"]) == ("Sure. " + call, False)
    # a stop string that is part of the marker is not matched across it
    assert _content_stops(call, ["<tool"]) == (call, False)
    # a marker followed by no call was content after all: the stop string applies
    assert _content_stops("<tool_call>\nnot a stop call", ["stop"]) == ("<tool_call>\nnot a ",
                                                                       True)
    assert _content_stops("plain text", ["xyz"]) == ("plain text", False)
    # a call cut by max_tokens is a call in progress still: handed out whole (finish "length")
    cut = call[:30]
    assert _content_stops(cut, ["name"], truncated=True) == (cut, False)
