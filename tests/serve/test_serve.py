"""`fuselm serve` through the official openai client (and raw HTTP for hostile input)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from click.testing import CliRunner

from fuselm.converter.cli.main import cli
from tests.serve.conftest import (
    MAX_BATCH,
    MAX_CONTEXT,
    MAX_QUEUE,
    MODEL,
    STARTUP_S,
    Server,
    start_server,
    stop_server,
    wait_up,
)

PROMPTS = [f"{w} the quick brown fox {i}" for i, w in enumerate(
    "Hello Rotary grouped metal onnx lazy dog world keys values queries fused "
    "graphs jumps over models".split())]
assert len(PROMPTS) == 16


def fuselm_run(srv: Server, prompt: str, n: int, raw: bool = False) -> dict:
    """What `fuselm run --temperature 0` prints for this prompt (same engine)."""
    args = ["run", str(srv.out_dir), "--prompt", prompt, "-n", str(n), "--temperature", "0",
            "--engine", srv.engine, "--json"] + (["--raw"] if raw else [])
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def chat(srv: Server, prompt: str, n: int, **kw: object):  # noqa: ANN201
    return srv.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=n,
        temperature=kw.pop("temperature", 0), **kw)


def test_models_and_health(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    one = server.client().models.retrieve(MODEL)  # GET /v1/models/{model}
    assert one.model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().models.retrieve("other")
    h = server.health()
    assert h["status"] == "ok" and h["max_batch"] == MAX_BATCH


def test_health_describes_the_batch_decoder_as_it_is_now(any_server: Server) -> None:
    """/health's `engine.batch` is the batch decoder described at the request: without a
    pipeline it has no slot counters, and its counts move as the server works (MLX: the KV
    blocks a finished request's cached prefix holds are those `kv.held_tokens` counts)."""
    chat(any_server, PROMPTS[2], 4)
    h = _wait_idle(any_server)
    batch = h["engine"]["batch"]
    shape = {"mode", "max_batch", "max_context", "active", "kv_budget_tokens"}
    if any_server.engine == "mlx":
        assert set(batch) == shape | {"kv_block", "kv_blocks", "kv_blocks_free"}
        held = (batch["kv_blocks"] - batch["kv_blocks_free"]) * batch["kv_block"]
        assert held == h["kv"]["held_tokens"] > 0
    else:
        assert set(batch) == shape
    assert batch["active"] == h["active"] == 0 and batch["max_batch"] == MAX_BATCH


def test_chat_greedy_equals_fuselm_run(any_server: Server) -> None:
    server = any_server
    want = fuselm_run(server, PROMPTS[0], 12)
    r = chat(server, PROMPTS[0], 12)
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.completion_tokens == len(want["tokens"]) + (want["stop_reason"] == "eos")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if want["stop_reason"] == "length"
                                          else "stop")


def test_completion_greedy_equals_fuselm_run(any_server: Server) -> None:
    server = any_server
    want = fuselm_run(server, PROMPTS[1], 10, raw=True)
    r = server.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10,
                                           temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming(server: Server) -> None:
    full = chat(server, PROMPTS[2], 16)
    stream = chat(server, PROMPTS[2], 16, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    comp = server.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8,
                                              temperature=0)
    pieces = server.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8,
                                                temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in pieces) == comp.choices[0].text


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_include_usage_chunks_as_openai_sends_them(server: Server, path: str) -> None:
    """With stream_options.include_usage every chunk has a `usage` field, null but in the
    last one before [DONE], whose `choices` is empty (OpenAI's shape); without it none has."""
    ask = ({"messages": [{"role": "user", "content": PROMPTS[2]}]} if path.startswith("chat")
           else {"prompt": PROMPTS[2]})
    for include in (True, False):
        with httpx.stream("POST", f"{server.url}/v1/{path}", timeout=60, json={
                "model": MODEL, **ask, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": include}}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        if include:
            assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        else:
            assert all("usage" not in c and c["choices"] for c in chunks)


def test_stop_strings(server: Server) -> None:
    text = chat(server, PROMPTS[3], 24).choices[0].message.content
    assert len(text) >= 6, text
    stop = text[3:5]  # a stop string first seen at or before offset 3
    cut = text[:text.index(stop)]
    r = chat(server, PROMPTS[3], 24, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in
              chat(server, PROMPTS[3], 24, stop=stop, stream=True) if c.choices]
    assert "".join(pieces) == cut  # nothing of the stop string leaked into the stream


def fuselm_run_stdout(srv: Server, prompt: str, n: int, *stop: str) -> str:
    """The text `fuselm run --raw --temperature 0` streams to stdout (then one newline)."""
    args = ["run", str(srv.out_dir), "--prompt", prompt, "--raw", "-n", str(n),
            "--temperature", "0", "--engine", srv.engine] + [
        a for s in stop for a in ("--stop", s)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert res.stdout.endswith("\n")
    return res.stdout[:-1]


# The tiny random model's greedy reply to this prompt: a byte that is no UTF-8 text, then a
# word over and over (a prompt through the chat template gets only newlines back).
STREAM_PROMPT = "Bonjour 日本 👋"


def test_run_api_and_serve_stream_the_same_text(any_server: Server) -> None:
    """One greedy request through `fuselm run`, the Python API's stream and the server's SSE
    stream (/v1/completions): the same text, with and without a stop string that spans
    tokens."""
    import fuselm
    from fuselm.runtime_metal.tokenizer import load_tokenizer

    server, prompt, n = any_server, STREAM_PROMPT, 24

    def served(*stop: str) -> str:
        chunks = server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            **({"stop": list(stop)} if stop else {}))
        return "".join(c.choices[0].text for c in chunks)

    model = fuselm.load(server.out_dir, engine=server.engine)

    def api(*stop: str) -> str:
        return "".join(model.stream(prompt, max_tokens=n, stop=list(stop), raw=True))

    want = fuselm_run(server, prompt, n, raw=True)
    text = fuselm_run_stdout(server, prompt, n)
    assert "\ufffd" in text and len(set(text)) > 2  # not a trivial reply
    assert text == want["text"] == served() == api()
    # A stop string across a token boundary (two characters each side), first seen there.
    tok = load_tokenizer(server.out_dir)
    ids = want["tokens"]
    bounds = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(1, len(ids))]
    stop = next(s for b in bounds if 2 <= b <= len(text) - 2 and "\ufffd" not in
                (s := text[b - 2:b + 2]) and text.index(s) == b - 2)
    cut = text[:text.index(stop)]
    assert len(cut) >= 2
    assert fuselm_run_stdout(server, prompt, n, stop) == cut
    assert served(stop) == cut
    assert api(stop) == cut


def test_seed_reproducible(server: Server) -> None:
    def sample(seed: int) -> str:
        return chat(server, PROMPTS[4], 16, temperature=1.0, seed=seed).choices[0].message.content

    a = sample(7)
    assert sample(7) == a
    assert any(sample(s) != a for s in (8, 9, 10))  # the seed does steer the draws


def test_sixteen_concurrent_streams_equal_solo(any_server: Server) -> None:
    import openai

    server = any_server
    solo = [chat(server, p, 12).choices[0].message.content for p in PROMPTS]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=120)

    async def one(p: str) -> str:
        s = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=12,
            temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    async def all_of() -> list[str]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 180)
        finally:
            await client.close()

    assert asyncio.run(all_of()) == solo


def _wait_idle(server: Server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if h["active"] == 0 and h["queued"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


def test_client_killed_mid_stream(any_server: Server) -> None:
    server = any_server
    client = textwrap.dedent(f"""
        import openai, sys
        c = openai.OpenAI(base_url={server.url + '/v1'!r}, api_key="none", max_retries=0)
        s = c.chat.completions.create(model={MODEL!r}, max_tokens=200, temperature=0,
            messages=[{{"role": "user", "content": "talk for a long time"}}], stream=True)
        for chunk in s:
            print("chunk", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE)
    try:
        for _ in range(3):  # it is streaming
            assert proc.stdout.readline() == b"chunk\n"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    h = _wait_idle(server)  # the slot is freed, not decoded to its 200 tokens
    assert h["status"] == "ok" and h["active"] == 0
    assert "cancelled" in server.log.read_text()
    assert chat(server, PROMPTS[5], 4).usage.completion_tokens == 4


def test_shutdown_ends_running_requests_with_a_503(smol_server: Server, tmp_path: Path
                                                   ) -> None:
    """SIGTERM while two requests decode (the real SmolLM2, EOS banned so they run on): they
    get their FINISH_S to finish, then the scheduler's 503 (a stream: its error event and
    [DONE]), before uvicorn's graceful timeout would cancel them into a bare 500 and a
    traceback; the server exits."""
    from fuselm.converter.serve.http_server import FINISH_S, GRACEFUL_S

    proc, srv = start_server(smol_server.out_dir, tmp_path / "server.log", "onnxruntime",
                             ["--max-context", "512", "--model-name", MODEL])
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
           "max_tokens": 400, "temperature": 0, "logit_bias": {"2": -100}}  # 2: <|im_end|>
    out: dict[str, httpx.Response | str] = {}

    def whole() -> None:
        out["whole"] = httpx.post(srv.url + "/v1/chat/completions", json=ask, timeout=60)

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                          json={**ask, "stream": True}) as r:
            out["stream"] = "".join(r.iter_text())

    try:
        wait_up(proc, srv, time.monotonic() + STARTUP_S)
        threads = [threading.Thread(target=f) for f in (whole, stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while srv.health()["active"] < 2 and time.monotonic() < deadline:  # both decode
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises it
        assert FINISH_S <= time.monotonic() - started < GRACEFUL_S + 5
    finally:
        stop_server(proc)
    whole_r = out["whole"]
    assert isinstance(whole_r, httpx.Response) and whole_r.status_code == 503, whole_r
    assert "shutting down" in whole_r.json()["error"]["message"]
    lines = [line for line in str(out["stream"]).split("\n") if line]
    assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2], lines[-3:]
    assert "Traceback" not in srv.log.read_text()


HOSTILE = {
    "huge max_tokens": (400, {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 10**12}),
    "negative temperature": (400, {"messages": [{"role": "user", "content": "hi"}],
                                   "temperature": -0.5}),
    "top_p zero": (400, {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}),
    "temperature a string": (400, {"messages": [{"role": "user", "content": "hi"}],
                                   "temperature": "hot"}),
    "messages a string": (400, {"messages": "hi"}),
    "no messages": (400, {"messages": []}),
    "content a number": (400, {"messages": [{"role": "user", "content": 5}]}),
    "unknown role": (400, {"messages": [{"role": "wizard", "content": "hi"}]}),
    "n=17": (400, {"messages": [{"role": "user", "content": "hi"}], "n": 17}),
    "stop a number": (400, {"messages": [{"role": "user", "content": "hi"}], "stop": 3}),
    "five stops": (400, {"messages": [{"role": "user", "content": "hi"}],
                         "stop": ["a", "b", "c", "d", "e"]}),
    "unknown model": (404, {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}),
    "1 MB prompt": (400, {"messages": [{"role": "user", "content": "fox " * 250_000}]}),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_json_requests(server: Server, name: str) -> None:
    status, body = HOSTILE[name]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "Traceback" not in r.text


@pytest.mark.parametrize("body,status", [
    (b'{"model": "tiny-qwen3", "prompt": "\xff\xfe bad"}', 400),  # invalid UTF-8
    (b'{"model": "tiny-qwen3", "prompt": ', 400),  # truncated JSON
    (b'[1, 2, 3]', 400),  # not an object
    (b'{"model": "tiny-qwen3", "prompt": [1, 99999]}', 400),  # token id past the vocabulary
    (b'{"model": "tiny-qwen3", "prompt": "' + b"a" * 3_000_000 + b'"}', 413),  # over --max-body
])
def test_hostile_bodies(server: Server, body: bytes, status: int) -> None:
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_the_server_survives_hostile_input(server: Server) -> None:
    assert server.health()["status"] == "ok"
    assert chat(server, PROMPTS[6], 3).usage.completion_tokens == 3


def test_queue_full_is_503(server: Server) -> None:
    n = MAX_BATCH + MAX_QUEUE + 16
    codes: list[int] = []

    def post() -> None:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "fox", "max_tokens": 40, "temperature": 0})
        codes.append(r.status_code)
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_full"

    threads = [threading.Thread(target=post) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(codes) == n and set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 1 and codes.count(200) >= MAX_BATCH
    assert _wait_idle(server)["status"] == "ok"


def test_prompt_cache_multi_turn(any_server: Server) -> None:
    """Turn 2 extends turn 1's prompt and reply: its prefix comes from the cache, and the
    reply is the one a fresh generation of the whole conversation gives."""
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate
    from fuselm.runtime_metal.tokenizer import load_tokenizer

    server = any_server
    client = server.client()
    first = [{"role": "user", "content": "Hello metal"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8,
                                        temperature=0)
    turn2 = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "and onnx?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8,
                                        temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    tok = load_tokenizer(server.out_dir)
    ids = tok.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    eng = make_engine(server.out_dir, server.engine)
    fresh = generate(eng, list(ids), max_new_tokens=8,
                     decode=lambda t: tok.decode(t, skip_special_tokens=True),
                     context_length=read_manifest(server.out_dir).model.context_length)
    assert r2.choices[0].message.content == fresh.text
    assert f"cached {r2.usage.prompt_tokens_details.cached_tokens}" in server.log.read_text()


def test_memory_flat_over_200_requests(server: Server) -> None:
    proc = psutil.Process(server.pid)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        def go(i: int) -> None:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[i % 16],
                                                   "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200

        for i in range(40):  # warm-up: allocator pools, tokenizer caches, ORT arenas
            go(i)
        before = proc.memory_info().rss
        for i in range(200):
            go(i)
        after = proc.memory_info().rss
    assert after - before < 16 * 2**20, (before, after)


def test_context_limit(server: Server) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": list(range(1, MAX_CONTEXT + 1)), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_context_limit_names_the_parameter_sent(server: Server, name: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], name: MAX_CONTEXT})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == name and f"lower {name}" in error["message"]
