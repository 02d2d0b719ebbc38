"""`fuselm serve` with a hostile chat template (tests/runtime/template_cases.py): each trigger is
an HTTP 400 JSON error naming the limit, the server stays up, and while one request's template
renders for its whole time limit, another small request is answered."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fuselm.runtime_metal.chat_template import DEFAULT_LIMITS
from tests.runtime.template_cases import HOSTILE, LONG, TRIGGERS
from tests.serve.conftest import MODEL, STARTUP_S, free_port, stop_server


@pytest.fixture(scope="module")
def url(serve_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server on a copy of the session's tiny model with the hostile template; stopped by
    PID (SIGTERM, then SIGKILL)."""
    root = tmp_path_factory.mktemp("hostile_serve")
    art = root / MODEL
    shutil.copytree(serve_artifact, art)
    (art / "chat_template.jinja").write_text(HOSTILE)
    port, log = free_port(), root / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fuselm.converter.cli.main", "serve", str(art), "--port",
             str(port), "--engine", "onnxruntime", "--max-context", "256"],
            stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        yield base
        assert "Traceback" not in log.read_text()
    finally:
        stop_server(proc)


def _chat(url: str, content: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": content}]})


@pytest.mark.parametrize("trigger", list(TRIGGERS))
def test_a_request_over_a_limit_is_a_400(url: str, trigger: str) -> None:
    t0 = time.monotonic()
    r = _chat(url, trigger)
    assert time.monotonic() - t0 < DEFAULT_LIMITS.seconds + 1.5
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert TRIGGERS[trigger][1] in err["message"] and err["param"] == "messages"
    assert err["code"] == ("chat_template_error" if trigger == "OVERFLOW"
                           else "chat_template_limit")
    assert _chat(url, "hello").status_code == 200  # the server carries on


def test_a_slow_render_does_not_stall_another_request(url: str) -> None:
    """A 30,000-character message through a template quadratic in it renders for the whole
    time limit (and is refused); a small request sent meanwhile is answered first."""
    slow: list[httpx.Response] = []
    done = threading.Event()

    def send() -> None:
        slow.append(_chat(url, "w" * (LONG + 20_000)))
        done.set()

    thread = threading.Thread(target=send)
    t0 = time.monotonic()
    thread.start()
    time.sleep(0.5)  # the slow one is rendering
    quick = _chat(url, "hello", timeout=DEFAULT_LIMITS.seconds)
    quick_done = time.monotonic() - t0
    assert quick.status_code == 200 and quick.json()["choices"][0]["message"]["content"]
    assert not done.is_set(), "the small request waited for the slow one"
    thread.join(timeout=30)
    assert slow and slow[0].status_code == 400
    assert "time limit" in slow[0].json()["error"]["message"]
    assert quick_done < DEFAULT_LIMITS.seconds, quick_done
