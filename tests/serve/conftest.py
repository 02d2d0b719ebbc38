"""One tiny converted model (GQA, head_dim != hidden/heads, trained BPE tokenizer with a chat
template) and one `fuselm serve` process on a free 127.0.0.1 port for the whole session; the
server is stopped by PID. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from fuselm.converter.models.builtin import build_model

MODEL = "tiny-qwen3"
STARTUP_S = 180  # imports + model load on a loaded 2-core CI box took 36 s
# Room for the 16-stream test (4 decoding + up to 16 waiting); a larger burst gets 503.
MAX_BATCH, MAX_QUEUE, MAX_CONTEXT = 4, 16, 256
SMOL_BATCH = 8  # the real model's server: 8 concurrent requests decode together


@dataclass
class Server:
    url: str
    pid: int
    out_dir: Path
    log: Path
    engine: str

    def client(self, **kw: object):  # noqa: ANN201 - openai.OpenAI
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=60, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fuselm.converter.pipeline import ConvertOptions, convert

    root = tmp_path_factory.mktemp("serve")
    hf = build_model(root / "hf", "qwen3", seed=5)
    out = root / MODEL
    convert(hf, out, ConvertOptions(dtype="float32"))
    return out


def start_server(artifact: Path, log: Path, engine: str, args: Sequence[str] = (),
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Server]:
    port = free_port()
    cmd = [sys.executable, "-m", "fuselm.converter.cli.main", "serve", str(artifact),
           "--port", str(port), "--engine", engine, "--max-batch", str(MAX_BATCH),
           "--max-queue", str(MAX_QUEUE), "--max-context", str(MAX_CONTEXT), *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=None if env is None else {**os.environ, **env})
    return proc, Server(f"http://127.0.0.1:{port}", proc.pid, artifact, log, engine)


def wait_up(proc: subprocess.Popen, srv: Server, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{srv.log.read_text()}")
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server not up after {STARTUP_S} s:\n{srv.log.read_text()}")
        time.sleep(0.3)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server started by a test, SIGKILL if it does not exit in 20 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextmanager
def running_server(artifact: Path, log: Path, engine: str, args: Sequence[str] = ()
                   ) -> Iterator[Server]:
    """One more `fuselm serve` (extra `args` after the standard ones), up for the block;
    stopped by PID."""
    proc, srv = start_server(artifact, log, engine, args)
    try:
        wait_up(proc, srv, time.monotonic() + STARTUP_S)
        yield srv
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def servers(serve_artifact: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Server]]:
    """`fuselm serve` on onnxruntime (the CPU default; its slots run one after another) and
    on MLX (sequences decode together in one batched step), started together, each in its own
    process; stopped by PID (SIGTERM, then SIGKILL)."""
    logs = tmp_path_factory.mktemp("serve_log")
    started = [start_server(serve_artifact, logs / f"{e}.log", e) for e in ("onnxruntime", "mlx")]
    try:
        deadline = time.monotonic() + STARTUP_S
        for proc, srv in started:
            wait_up(proc, srv, deadline)
        yield {srv.engine: srv for _, srv in started}
    finally:
        for proc, _ in started:
            stop_server(proc)


@pytest.fixture(scope="session")
def server(servers: dict[str, Server]) -> Server:
    return servers["onnxruntime"]


@pytest.fixture(params=["onnxruntime", "mlx"])
def any_server(request: pytest.FixtureRequest, servers: dict[str, Server]) -> Server:
    """The tests of output equality and slot handling, on both engines."""
    return servers[request.param]


API_KEY = "test-key-7f3a9c"
ALLOWED_HOST = "fuselm.test"


@dataclass
class Guarded:
    """Servers and pages for the access tests: `open` has no key and allows one web origin
    (`allowed_page`) and one extra Host name; `keyed` needs API_KEY (from FUSELM_API_KEY).
    `foreign_page` serves from an origin neither allows."""

    open: Server
    keyed: Server
    allowed_page: str
    foreign_page: str


def _page_server(root: Path) -> ThreadingHTTPServer:
    handler = partial(SimpleHTTPRequestHandler, directory=str(root))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, name="page-server", daemon=True).start()
    return httpd


@pytest.fixture(scope="session")
def guarded(serve_artifact: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Guarded]:
    """Two `fuselm serve` processes (onnxruntime) and two tiny http.server page origins on
    127.0.0.1; all stopped at the end (servers by PID)."""
    root = tmp_path_factory.mktemp("pages")
    (root / "index.html").write_text("<!doctype html><title>page</title><p>a web page</p>")
    pages = [_page_server(root) for _ in range(2)]
    allowed, foreign = (f"http://127.0.0.1:{p.server_address[1]}" for p in pages)
    logs = tmp_path_factory.mktemp("guarded_log")
    started = [
        start_server(serve_artifact, logs / "open.log", "onnxruntime",
                     ["--cors-origin", allowed, "--allowed-host", ALLOWED_HOST]),
        start_server(serve_artifact, logs / "keyed.log", "onnxruntime",
                     env={"FUSELM_API_KEY": API_KEY}),
    ]
    try:
        deadline = time.monotonic() + STARTUP_S
        for proc, srv in started:
            wait_up(proc, srv, deadline)
        yield Guarded(started[0][1], started[1][1], allowed, foreign)
    finally:
        for proc, _ in started:
            stop_server(proc)
        for p in pages:
            p.shutdown()
            p.server_close()


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`fuselm serve` on the real SmolLM2-135M Q4 (onnxruntime, lowered: batched rows), at
    accuracy level 0: at level 4 a step of several tokens of one sequence (a prefill, the
    uncached rest of a prompt) computes unlike one-token steps (GroupQueryAttention's
    several-row kernel, a 1-ulp difference the int8 activations amplify:
    benchmarks/probes/verify_rows.py), so a served row may pick another token at a near-tie
    than a reference that reached the same position another way. Shared by the delivery and
    structured-output tests (one conversion per session)."""
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.converter.pipeline import ConvertOptions, convert

    root = tmp_path_factory.mktemp("smol_serve")
    out = root / "smol"
    convert(bundled_gguf(), out, ConvertOptions.from_flags(quant="q4"))
    # the standard server with this model's batch, context and name (the later flags win)
    with running_server(out, root / "server.log", "onnxruntime",
                        ["--max-batch", str(SMOL_BATCH), "--max-context", "512",
                         "--model-name", MODEL, "--accuracy-level", "0"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def speculative_server(serve_artifact: Path, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[Server]:
    """`fuselm serve --draft-lookup` on onnxruntime: speculative decoding with batching on."""
    log = tmp_path_factory.mktemp("serve_spec_log") / "spec.log"
    with running_server(serve_artifact, log, "onnxruntime",
                        ["--draft-lookup", "--num-draft", "4"]) as srv:
        yield srv
