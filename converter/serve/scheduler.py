"""The serving scheduler: one thread owns the engine and drives a batch decoder (add -> slot,
step -> {slot: token}, remove); requests arrive through a thread-safe queue and leave through
per-request asyncio queues. New requests join between steps, finished or cancelled ones leave
at once, so a client that disconnects frees its slot before the next step."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.sampling import SamplingOptions
from fuselm.runtime_metal.text_stream import TextStream

log = logging.getLogger("fuselm.serve")


class BatchDecoder(Protocol):
    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions) -> int: ...

    def step(self) -> dict[int, int]: ...

    def remove(self, slot: int) -> None: ...

    def cached_tokens(self, slot: int) -> int: ...

    def reset(self) -> None: ...


class QueueFull(Exception):
    """More requests wait than --max-queue allows (HTTP 503)."""


@dataclass
class Job:
    """One request as the engine thread sees it; events go to `events` on the caller's loop:
    ("delta", text), ("done", finish_reason, usage dict) or ("error", status, message)."""

    rid: str
    prompt: list[int]
    sampling: SamplingOptions
    max_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0
    cached: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    text: TextStream | None = None

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the server's loop has closed (shutdown): nobody listens
            self.cancelled.set()


class Scheduler:
    """`make_decoder` runs on the engine thread: MLX binds its streams (and compiled programs)
    to the thread that makes them, so the engine is built where it will run."""

    def __init__(self, make_decoder: Callable[[], BatchDecoder],
                 decode: Callable[[list[int]], str], eos_ids: Sequence[int],
                 max_batch: int = 8, max_queue: int = 64) -> None:
        self._make_decoder = make_decoder
        self.decoder: BatchDecoder | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.decode = decode
        self.eos = set(int(e) for e in eos_ids)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._pending: queue.Queue[Job | None] = queue.Queue()
        self._active: dict[int, Job] = {}
        # Since start, for /health: what reached the engine (a refused request never does).
        self._admitted = self._generated = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fuselm-engine", daemon=True)

    # -- called from the server's event loop --------------------------------------------
    def start(self) -> None:
        """Start the engine thread; return once its decoder is built (re-raising its error)."""
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        self._stopping.set()
        self._pending.put(None)
        self._thread.join(timeout=10)

    def submit(self, job: Job) -> None:
        if self._pending.qsize() >= self.max_queue:
            raise QueueFull(f"{self._pending.qsize()} requests are waiting (--max-queue "
                            f"{self.max_queue}); retry later")
        self._pending.put(job)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        return {"active": len(self._active), "queued": self._pending.qsize(),
                "max_batch": self.max_batch, "admitted": self._admitted,
                "generated_tokens": self._generated}

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.decoder = self._make_decoder()
        except BaseException as e:  # handed to start(): a user error prints as one line
            self._failure = e
            return
        finally:
            self._ready.set()
        while not self._stopping.is_set():
            self._admit()
            self._drop_cancelled()
            if not self._active:
                continue
            assert self.decoder is not None
            try:
                out = self.decoder.step()
            except Exception:  # an engine bug must not kill the server: fail these requests
                log.exception("engine step failed; failing %d request(s)", len(self._active))
                for job in self._active.values():
                    job.emit("error", 500, "the engine failed on this request (see the "
                                           "server log)")
                self._active.clear()
                self.decoder.reset()
                continue
            for slot, token in out.items():
                job = self._active.get(slot)
                if job is not None:
                    self._on_token(slot, job, token)
        for job in self._active.values():
            job.emit("error", 503, "the server is shutting down")

    def _admit(self) -> None:
        assert self.decoder is not None
        while len(self._active) < self.max_batch:
            try:
                job = self._pending.get(block=not self._active, timeout=0.5)
            except queue.Empty:
                return
            if job is None or job.cancelled.is_set():
                continue
            try:
                slot = self.decoder.add(job.prompt, job.sampling)
            except RuntimeUserError as e:
                job.emit("error", 400, str(e))
                continue
            job.text = TextStream(self.decode, job.stop)
            self._active[slot] = job
            self._admitted += 1

    def _drop_cancelled(self) -> None:
        for slot, job in list(self._active.items()):
            if job.cancelled.is_set():
                self._finish(slot, job, "cancelled")

    def _on_token(self, slot: int, job: Job, token: int) -> None:
        assert job.text is not None and self.decoder is not None
        if job.generated == 0:
            job.t_first = time.perf_counter()
            job.cached = self.decoder.cached_tokens(slot)
        job.generated += 1
        self._generated += 1
        finish = None
        if token in self.eos:
            finish = "stop"
        else:
            delta = job.text.push(token)
            if delta:
                job.emit("delta", delta)
            if job.text.stopped:
                finish = "stop"
        if finish is None and job.generated >= job.max_tokens:
            finish = "length"
        if finish is not None:
            rest = job.text.finish()
            if rest:
                job.emit("delta", rest)
            self._finish(slot, job, "stop" if job.text.stopped else finish)

    def _finish(self, slot: int, job: Job, reason: str) -> None:
        assert self.decoder is not None
        self.decoder.remove(slot)
        del self._active[slot]
        now = time.perf_counter()
        use = {"prompt_tokens": len(job.prompt), "completion_tokens": job.generated,
               "cached_tokens": job.cached}
        if reason != "cancelled":
            job.emit("done", reason, use)
        ttft = (job.t_first - job.t_submit) * 1e3 if job.t_first else float("nan")
        log.info("%s %s: prompt %d tok (cached %d), completion %d tok, ttft %.0f ms, "
                 "total %.0f ms", job.rid, reason, len(job.prompt), job.cached, job.generated,
                 ttft, (now - job.t_submit) * 1e3)
