"""One tiny converted model (GQA, head_dim != hidden/heads, trained BPE tokenizer with a chat
template) and one `fuselm serve` process on a free 127.0.0.1 port for the whole session; the
server is stopped by PID. Every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fuselm.converter.builtin import build_model

MODEL = "tiny-qwen3"
STARTUP_S = 180  # imports + model load on a loaded 2-core CI box took 36 s
# Room for the 16-stream test (4 decoding + up to 16 waiting); a larger burst gets 503.
MAX_BATCH, MAX_QUEUE, MAX_CONTEXT = 4, 16, 256


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


@contextlib.contextmanager
def running_server(artifact: Path, log: Path, engine: str) -> Iterator[Server]:
    """`fuselm serve` in its own process until the block ends (SIGTERM by PID, then SIGKILL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "fuselm.converter.cli", "serve", str(artifact),
           "--port", str(port), "--engine", engine, "--max-batch", str(MAX_BATCH),
           "--max-queue", str(MAX_QUEUE), "--max-context", str(MAX_CONTEXT)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc.pid, artifact, log, engine)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not up after {STARTUP_S} s:\n{log.read_text()}")
            time.sleep(0.3)
        yield srv
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def server(serve_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """onnxruntime: the CPU default engine."""
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    with running_server(serve_artifact, log, "onnxruntime") as srv:
        yield srv


@pytest.fixture(scope="session")
def mlx_server(serve_artifact: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Server]:
    """MLX: sequences decode together in one batched step."""
    log = tmp_path_factory.mktemp("serve_log") / "server_mlx.log"
    with running_server(serve_artifact, log, "mlx") as srv:
        yield srv


@pytest.fixture(params=["onnxruntime", "mlx"])
def any_server(request: pytest.FixtureRequest) -> Server:
    """The tests of output equality and slot handling, on both engines."""
    return request.getfixturevalue("server" if request.param == "onnxruntime" else "mlx_server")
