"""`fuselm serve --max-kv-tokens`: a server on MLX (the block KV cache) whose whole budget is one
sequence of its context, driven by 1,000 requests of random lengths from four clients at once:
every request is answered or refused by the rule (HTTP 503 exactly for those that could never
fit), the KV reservations never pass the budget, and the server's memory stays flat; a chat past
the window is cut by chat_window's rule."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from fuselm.runtime_metal.kv_cache import BLOCK
from fuselm.runtime_metal.tokenizer import load_tokenizer
from tests.serve.conftest import MAX_CONTEXT, MODEL, Server, running_server

BUDGET = 4 * BLOCK  # one sequence of MAX_CONTEXT: requests wait for one another
WINDOW = BUDGET - 1  # the longest prompt + completion the budget holds (one position fed ahead)


@pytest.fixture(scope="module")
def budget_server(serve_artifact: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("kv_budget") / "mlx.log"
    with running_server(serve_artifact, log, "mlx", ["--max-kv-tokens", str(BUDGET)]) as srv:
        yield srv


def cost(n: int) -> int:
    """KV positions a request of n tokens (prompt + max_tokens) reserves: whole blocks."""
    return -(-(n + 1) // BLOCK) * BLOCK


def test_startup_and_health_say_the_budget(budget_server: Server) -> None:
    h = budget_server.health()
    assert h["kv"] == {"budget_tokens": BUDGET, "reserved_tokens": 0, "free_tokens": BUDGET,
                       "held_tokens": h["kv"]["held_tokens"]}
    assert h["engine"]["batch"]["kv_blocks"] == BUDGET // BLOCK
    assert h["memory"]["mlx_active_bytes"] > 0
    log = budget_server.log.read_text()
    assert f"KV budget: {BUDGET} tokens (" in log and f"chats are cut to {WINDOW} tokens" in log


def test_a_thousand_requests_in_bounded_memory(budget_server: Server) -> None:
    rng = random.Random(7)
    vocab = 384  # the test model's
    requests = []
    for i in range(1000):
        if i % 50 == 49:  # fits the context, never the budget
            p, m = MAX_CONTEXT - 6, 6
        elif i % 25 == 12:  # a large one: the others wait while it runs
            p, m = rng.randint(150, 200), rng.randint(1, 4)
        else:
            p, m = rng.randint(1, 48), rng.randint(1, 4)
        requests.append(([rng.randrange(4, vocab) for _ in range(p)], m))
    proc = psutil.Process(budget_server.pid)
    start = budget_server.health()
    results: list[tuple[int, dict] | None] = [None] * len(requests)
    memory: dict[int, tuple[int, int]] = {}
    local = threading.local()
    seen = {"reserved": 0, "held": 0, "queued": 0}
    polling = threading.Event()

    def poll() -> None:  # the budget is never passed, whatever moment /health is read
        with httpx.Client(base_url=budget_server.url, timeout=30) as http:
            while not polling.is_set():
                h = http.get("/health").json()
                seen["reserved"] = max(seen["reserved"], h["kv"]["reserved_tokens"])
                seen["held"] = max(seen["held"], h["kv"]["held_tokens"])
                seen["queued"] = max(seen["queued"], h["queued"])
                time.sleep(0.02)

    def send(i: int) -> None:
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=budget_server.url, timeout=120)
        prompt, m = requests[i]
        r = local.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                     "max_tokens": m, "temperature": 0})
        results[i] = (r.status_code, r.json())

    def measure(n: int) -> None:  # once the first n requests are answered, the server idle
        h = budget_server.health()
        assert h["active"] == h["queued"] == 0
        memory[n] = (proc.memory_info().rss, h["memory"]["mlx_active_bytes"])

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(send, range(100)))
            measure(100)
            list(pool.map(send, range(100, len(requests))))
            measure(len(requests))
    finally:
        polling.set()
        watcher.join(timeout=30)
    for (prompt, m), res in zip(requests, results, strict=True):
        assert res is not None  # answered
        status, body = res
        if cost(len(prompt) + m) > BUDGET:
            assert status == 503 and body["error"]["code"] == "kv_budget_exceeded", body
            assert f"needs {cost(len(prompt) + m)} KV cache tokens" in body["error"]["message"]
        else:
            assert status == 200, body
            choice, usage = body["choices"][0], body["usage"]
            assert usage["prompt_tokens"] == len(prompt)
            assert usage["completion_tokens"] == m or choice["finish_reason"] == "stop"
    refused = sum(cost(len(p) + m) > BUDGET for p, m in requests)
    assert refused == 20
    assert 0 < seen["reserved"] <= BUDGET and seen["held"] <= BUDGET
    end = budget_server.health()
    assert end["kv"]["reserved_tokens"] == 0 and end["active"] == end["queued"] == 0
    assert end["admitted"] - start["admitted"] == len(requests) - refused  # none lost
    (rss0, mlx0), (rss1, mlx1) = memory[100], memory[len(requests)]
    assert abs(rss1 - rss0) <= 0.05 * rss0, (rss0, rss1)
    assert abs(mlx1 - mlx0) <= 0.05 * mlx0, (mlx0, mlx1)


def _render(tok, messages: list[dict]) -> list[int]:  # noqa: ANN001
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_long_chat_is_cut_to_the_window(budget_server: Server) -> None:
    """system + 8 turns over the window: the server keeps the system prompt and the last turns
    that fit with max_tokens (the rule tried cut by cut here), says how many messages it
    dropped in a header, and answers; a conversation that fits is left whole."""
    tok = load_tokenizer(budget_server.out_dir)
    system = {"role": "system", "content": "answer in one word"}
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"tell me about fox {i} and the lazy dog"},
                  {"role": "assistant", "content": f"fox {i} jumps over the lazy dog quickly"}]
    conv = [system, *turns, {"role": "user", "content": "and the last one?"}]
    max_tokens = 8
    assert len(_render(tok, conv)) + max_tokens > WINDOW
    for drop in range(1, 9):
        kept = [system, *turns[2 * drop:], conv[-1]]
        if len(_render(tok, kept)) + max_tokens <= WINDOW:
            break
    with httpx.Client(base_url=budget_server.url, timeout=60) as http:
        body = {"model": MODEL, "messages": conv, "max_tokens": max_tokens}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-fuselm-dropped-messages"] == str(2 * drop)
        assert r.json()["usage"]["prompt_tokens"] == len(_render(tok, kept))
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["x-fuselm-dropped-messages"] == str(2 * drop)
            s.read()
        short = http.post("/v1/chat/completions", json={**body, "messages": kept})
        assert short.status_code == 200 and "x-fuselm-dropped-messages" not in short.headers
        assert short.json()["usage"]["prompt_tokens"] == len(_render(tok, kept))
        # no max_tokens: the reply stops where the budget would, rather than a 503
        free = http.post("/v1/chat/completions", json={"model": MODEL, "messages": kept,
                                                        "temperature": 0})
        assert free.status_code == 200, free.text
        use = free.json()["usage"]
        assert use["prompt_tokens"] + use["completion_tokens"] <= WINDOW
        # the last turn alone is over the window: refused as before, not cut
        long = {"role": "user", "content": " ".join(["fox"] * 400)}
        r = http.post("/v1/chat/completions", json={**body, "messages": [system, long]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
