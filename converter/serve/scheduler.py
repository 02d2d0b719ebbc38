"""The serving scheduler: one thread owns the engine and drives a batch decoder (add -> slot,
step -> {slot: token}, remove); requests arrive through a thread-safe queue. New requests join
between steps, finished or cancelled ones leave at once, so a client that disconnects frees its
slot before the next step.

The engine thread never waits for HTTP and does no per-token text work: a step appends each
row's token id to its Job and wakes the event loop once (only for jobs whose reader waits).
A request's first token is handed over as soon as its prefill made it, when it joins (the step
that feeds it does not report it again): not after the prefills of the requests joining with
it and the next step.
Detokenizing, stop strings, JSON and sockets happen on the event loop (delivery.py), which
takes every token that arrived since it last looked: a slow client gets them as one larger
chunk while the batch keeps its pace. A reader that saw a stop string or lost its client sets
`cancelled`, and the engine removes that row before its next step.

Admission against the KV budget (the decoder's `kv_budget` positions, all rows together): a
request reserves, when it joins, the KV positions its prompt plus max_tokens can ever hold
(`kv_cost`), and gives them back when it leaves; it joins only while the reservations fit the
budget. So a running row never finds the cache full mid-generation (no preemption is needed),
and a request that does not fit now waits, first come first served, until running ones
leave. One that could never fit (its cost alone is over the budget) is refused when submitted;
one that waits longer than `queue_timeout` is refused then (both HTTP 503, with the numbers)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fuselm.runtime_metal.constraint import TokenConstraint
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.sampling import SamplingOptions, TokenLogprobs
from fuselm.runtime_metal.tool_calls import ToolFormat

log = logging.getLogger("fuselm.serve")


class BatchDecoder(Protocol):
    max_batch: int
    kv_budget: int  # KV positions, all rows together

    def kv_cost(self, tokens: int) -> int: ...

    def kv_held(self) -> int: ...

    def memory(self) -> dict[str, int]: ...

    def describe(self) -> dict[str, object]: ...

    @property
    def exhausted(self) -> set[int]: ...

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions, *,
            top_logprobs: int | None = None, fork_of: int | None = None,
            constraint: TokenConstraint | None = None) -> int: ...

    def step(self) -> dict[int, list[int]]:
        """Each active slot's new tokens of one step, in order (several with speculative
        decoding)."""
        ...

    def logprobs(self, slot: int) -> TokenLogprobs | None: ...

    def first_token(self, slot: int) -> int:
        """The first token of the sequence just added in `slot` (sampled from its prompt's
        logits), which the next step reports again."""
        ...

    def remove(self, slot: int) -> None: ...

    def cached_tokens(self, slot: int) -> int: ...

    def reset(self) -> None: ...

    def idle(self) -> None:
        """Called while no request runs (about every half second)."""
        ...


class QueueFull(Exception):
    """More requests wait than --max-queue allows (HTTP 503)."""


class OverBudget(Exception):
    """The request's prompt plus max_tokens needs more KV cache than the whole budget (HTTP
    503: it could never run on this server)."""


class EngineLost(Exception):
    """The engine cannot go on (a rank of a `--parallel` job is gone): the scheduler stops,
    its requests and later ones get HTTP 503 with this message, /health reports it."""


@dataclass
class Job:
    """One request, shared by the engine thread (which writes `tokens`, then `finish`) and its
    reader on the event loop (`take`). `tokens` holds the generated ids but an EOS; `generated`
    counts the EOS too. `finish`: "stop" (EOS), "length", "error" (`error` says what) or
    "shutdown". `top_logprobs` (None: none) asks for each token's logprobs, appended to
    `logprobs` before the token to `tokens`. `fork_of`: a request's earlier choice from the same
    prompt (OpenAI's n > 1), whose prompt this one shares when both join the batch together."""

    rid: str
    prompt: list[int]
    sampling: SamplingOptions
    max_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    top_logprobs: int | None = None
    fork_of: Job | None = None
    # The request's tool calls' format and functions: stop strings apply outside a call only
    # (delivery.ContentStops). None: no tools, the stop strings apply to all the text.
    tool_format: ToolFormat | None = None
    tool_names: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    slot: int | None = None  # the engine thread's: the batch row it decodes in
    finish: str | None = None
    error: tuple[int, str] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended_by: str = "cancelled"  # what the reader logs when it cancels (e.g. "stop" string)
    generated: int = 0
    cached: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    # the engine thread's: its first token went out when it joined, so the step that reports
    # it again is skipped
    early: bool = False
    read: int = 0  # tokens the reader has taken
    # What the sleeping reader wants the engine to wake it for: None (it is not asleep),
    # "token" (anything new) or "finish" (only the end: it is waiting out its chunk interval).
    waiting: str | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    constraint: TokenConstraint | None = None  # the reply's grammar (its row's own mask)

    async def take(self, not_before: float = 0.0) -> tuple[list[int], str | None]:
        """The tokens that arrived since the last call, and the finish reason once the engine
        is done with this job (then no more tokens come). Waits for at least one token, and
        until the loop's clock reaches `not_before` unless the job finishes first."""
        loop = asyncio.get_running_loop()
        while True:
            finish = self.finish  # read before the tokens: the engine sets it after the last
            n = len(self.tokens)
            early = loop.time() < not_before
            if finish is not None or (n > self.read and not early):
                new, self.read = self.tokens[self.read:n], n
                return new, finish
            self.wake.clear()
            self.waiting = "finish" if early else "token"
            if self.finish is not None or (len(self.tokens) > n and not early):
                self.waiting = None  # it came between the look and the flag: no sleep
                continue
            if not early:
                await self.wake.wait()
                continue
            try:
                await asyncio.wait_for(self.wake.wait(), not_before - loop.time())
            except TimeoutError:
                pass
            self.waiting = None


def _wake(jobs: list[Job]) -> None:
    for job in jobs:
        job.wake.set()


class Scheduler:
    """`make_decoder` runs on the engine thread: MLX binds its streams (and compiled programs)
    to the thread that makes them, so the engine is built where it will run."""

    def __init__(self, make_decoder: Callable[[], BatchDecoder],
                 decode: Callable[[list[int]], str], eos_ids: Sequence[int],
                 max_batch: int = 8, max_queue: int = 64,
                 queue_timeout: float | None = None) -> None:
        self._make_decoder = make_decoder
        self.decoder: BatchDecoder | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        # The readers' detokenizer (delivery.py, on the event loop; the handlers encode with
        # a tokenizer of their own: a fast tokenizer is not safe to share across threads).
        self.decode = decode
        self.eos = set(int(e) for e in eos_ids)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout  # seconds a request may wait to join; None: no limit
        self._pending: queue.Queue[Job | None] = queue.Queue()
        self._waiting: deque[Job] = deque()  # taken from _pending, waiting to join (in order)
        self._active: dict[int, Job] = {}
        self._reserved: dict[int, int] = {}  # slot -> KV positions its job reserved
        self._reserved_total = 0  # their sum (read by /health on the event loop: one int)
        self._touched: list[Job] = []  # jobs with news since the last wake-up call
        # Since start, for /health: what reached the engine (a refused request never does).
        self._admitted = self._generated = 0
        self.lost: str | None = None  # why the engine stopped for good (EngineLost)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fuselm-engine", daemon=True)
        self._wakeups: queue.SimpleQueue[list[Job] | None] = queue.SimpleQueue()
        self._waker = threading.Thread(target=self._notifier, name="fuselm-wake", daemon=True)

    # -- called from the server's event loop --------------------------------------------
    def start(self) -> None:
        """Start the engine thread; return once its decoder is built (re-raising its error)."""
        self._waker.start()
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        self._stopping.set()
        self._pending.put(None)
        self._thread.join(timeout=10)
        self._wakeups.put(None)  # after the engine's last wake-ups
        self._waker.join(timeout=10)

    def submit(self, *jobs: Job) -> None:
        """Queue the jobs of one request together (its n choices), or none of them."""
        if self.lost is not None:
            raise EngineLost(self.lost)
        assert self.decoder is not None, "start() first"
        for job in jobs:
            need = self.decoder.kv_cost(len(job.prompt) + job.max_tokens)
            if need > self.decoder.kv_budget:
                raise OverBudget(
                    f"this request needs {need} KV cache tokens ({len(job.prompt)} in the "
                    f"prompt + {job.max_tokens} max_tokens) but the server's whole KV budget "
                    f"is {self.decoder.kv_budget} tokens (--max-kv-tokens / --memory-limit); "
                    "lower max_tokens or shorten the prompt")
        waiting = self._pending.qsize() + len(self._waiting)
        if waiting + len(jobs) > self.max_queue:
            raise QueueFull(f"{waiting} requests are waiting (--max-queue "
                            f"{self.max_queue}); retry later")
        for job in jobs:
            self._pending.put(job)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, object]:
        return {"active": len(self._active),
                "queued": self._pending.qsize() + len(self._waiting),
                "max_batch": self.max_batch, "admitted": self._admitted,
                "generated_tokens": self._generated, "kv": self.kv_stats(),
                "memory": self.decoder.memory() if self.decoder is not None else {}}

    def kv_stats(self) -> dict[str, int]:
        """KV cache use in positions (tokens): `budget` in all; `reserved` by running requests
        (prompt + max_tokens each, what admission counts); `free` = budget - reserved, what a
        new request can have now; `held`: positions the cache holds now (running rows and
        finished ones' cached prefixes, which give way to new requests)."""
        assert self.decoder is not None
        budget, reserved = self.decoder.kv_budget, self._reserved_total
        return {"budget_tokens": budget, "reserved_tokens": reserved,
                "free_tokens": budget - reserved, "held_tokens": self.decoder.kv_held()}

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.decoder = self._make_decoder()
        except BaseException as e:  # handed to start(): a user error prints as one line
            self._failure = e
            return
        finally:
            if self.decoder is not None:  # the KV budget may hold fewer rows than asked
                self.max_batch = min(self.max_batch, self.decoder.max_batch)
            self._ready.set()
        try:
            self._loop()
        except EngineLost as e:
            self.lost = str(e)
            log.error("%s", e)
            for job in self._active.values():
                self._end(job, "error", (503, self.lost))
            self._active.clear()
            while not self._pending.empty():
                job = self._pending.get()
                if job is not None:
                    self._end(job, "error", (503, self.lost))
            self._notify()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._admit()
            self._drop_cancelled()
            if not self._active:
                self.decoder.idle()  # type: ignore[union-attr]
                continue
            assert self.decoder is not None
            try:
                out = self.decoder.step()
                for slot, tokens in out.items():
                    for token in tokens:  # a request that ends drops the tokens after its last
                        job = self._active.get(slot)
                        if job is None:
                            break
                        if job.early:  # its first token, sent when it joined
                            job.early = False
                            continue
                        self._on_token(slot, job, token)
            except EngineLost:
                raise
            except Exception:  # an engine bug must not kill the server: fail these requests
                log.exception("engine step failed; failing %d request(s)", len(self._active))
                for job in self._active.values():
                    self._end(job, "error", (500, "the engine failed on this request (see "
                                                  "the server log)"))
                self._notify()
                self._active.clear()
                self._reserved.clear()
                self._reserved_total = 0
                self.decoder.reset()
                continue
            self._end_exhausted()
            self._notify()
        submitted = []  # not yet taken into the wait line
        while not self._pending.empty():
            if (job := self._pending.get()) is not None:
                submitted.append(job)
        for job in [*self._active.values(), *self._waiting, *submitted]:
            self._end(job, "shutdown", (503, "the server is shutting down"))
        self._notify()

    def _admit(self) -> None:
        """Take the submitted jobs into the wait line, refuse those that waited too long, and
        let the first ones join while a slot is free and their KV reservation fits. A job's
        first token goes to its reader as soon as its prefill made it, before the next join
        and the step (_first_tokens)."""
        assert self.decoder is not None
        idle = not self._active and not self._waiting
        while True:
            try:
                job = self._pending.get(block=idle, timeout=0.5)
            except queue.Empty:
                break
            idle = False
            if job is not None:
                self._waiting.append(job)
        self._expire_waiting()
        joined: list[Job] = []  # joined, their first token not yet out
        while self._waiting and len(self._active) < self.max_batch:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                continue
            need = self.decoder.kv_cost(len(job.prompt) + job.max_tokens)
            if self._reserved_total + need > self.decoder.kv_budget:
                break  # it waits (and those behind it) until running requests leave
            self._waiting.popleft()
            parent = job.fork_of
            like = parent.slot if parent is not None and parent.slot is not None and (
                self._active.get(parent.slot) is parent) else None
            try:
                slot = self.decoder.add(job.prompt, job.sampling, top_logprobs=job.top_logprobs,
                                        fork_of=like, constraint=job.constraint)
            except RuntimeUserError as e:
                self._end(job, "error", (400, str(e)))
                self._notify()
                continue
            except EngineLost as e:
                self._end(job, "error", (503, str(e)))
                raise
            self._active[slot] = job
            self._reserved[slot] = need
            self._reserved_total += need
            job.slot = slot
            self._admitted += 1
            joined.append(job)
            after = self._waiting[0].fork_of if self._waiting else None
            if not any(after is j for j in joined):  # a fork joins before the token is out
                self._first_tokens(joined)
        self._first_tokens(joined)

    def _first_tokens(self, jobs: list[Job]) -> None:
        """The first tokens of jobs that just joined, to their readers now (time to first
        token: where the next step would hand them out after the other joins' prefills and
        its own work); that step's report of them is skipped (`early`)."""
        assert self.decoder is not None
        for job in jobs:
            slot = job.slot
            if slot is not None and self._active.get(slot) is job:
                job.early = True
                self._on_token(slot, job, self.decoder.first_token(slot))
        jobs.clear()
        self._notify()

    def _expire_waiting(self) -> None:
        if self.queue_timeout is None or not self._waiting:
            return
        now = time.perf_counter()
        kept: deque[Job] = deque()
        for job in self._waiting:
            if now - job.t_submit <= self.queue_timeout or job.cancelled.is_set():
                kept.append(job)
                continue
            assert self.decoder is not None
            self._end(job, "error", (503, (
                f"waited {now - job.t_submit:.2f} s (--queue-timeout {self.queue_timeout:g}) "
                f"for {self.decoder.kv_cost(len(job.prompt) + job.max_tokens)} KV cache tokens; "
                f"{self._reserved_total} of {self.decoder.kv_budget} are reserved by "
                f"{len(self._active)} running request(s); retry later")))
        self._waiting = kept
        self._notify()

    def _end_exhausted(self) -> None:
        """A row that can take no more tokens ends as "length" rather than never ending. Not
        expected: admission reserves a row's whole KV, and max_tokens keeps it inside the
        context."""
        assert self.decoder is not None
        for slot in list(self.decoder.exhausted & self._active.keys()):
            job = self._active[slot]
            log.warning("%s: no more KV cache room after %d tokens; ended as length",
                        job.rid, job.generated)
            self._finish(slot, job, "length")

    def _drop_cancelled(self) -> None:
        for slot, job in list(self._active.items()):
            if job.cancelled.is_set():
                self._finish(slot, job, "cancelled")
        self._notify()

    def _on_token(self, slot: int, job: Job, token: int) -> None:
        """Per token only what decides whether the row goes on: EOS and max_tokens (stop
        strings need text: the reader finds them and cancels the job)."""
        assert self.decoder is not None
        if job.generated == 0:
            job.t_first = time.perf_counter()
            job.cached = self.decoder.cached_tokens(slot)
        job.generated += 1
        self._generated += 1
        if token in self.eos:
            self._finish(slot, job, "stop")
            return
        if job.top_logprobs is not None:
            info = self.decoder.logprobs(slot)
            assert info is not None and info.token == token
            job.logprobs.append(info)
        job.tokens.append(token)
        if job.generated >= job.max_tokens:
            self._finish(slot, job, "length")
        else:
            self._touched.append(job)

    def _end(self, job: Job, finish: str, error: tuple[int, str] | None = None) -> None:
        job.error = error
        job.finish = finish  # after the last token and the error: the reader looks at it first
        self._touched.append(job)

    def _notify(self) -> None:
        """One wake-up call per step for the readers that sleep (a reader busy sending
        will find the new tokens when it comes back)."""
        sleeping = []
        for job in self._touched:
            if job.waiting == "token" or (job.waiting and job.finish is not None):
                job.waiting = None
                sleeping.append(job)
        self._touched.clear()
        if sleeping:
            self._wakeups.put(sleeping)

    def _notifier(self) -> None:
        """Hands the engine's wake-ups to the event loop. The engine thread only queues them
        (no system call, the GIL kept): this thread's call_soon_threadsafe, and the loop's
        turn it starts, run while the engine thread has let the GIL go inside its next step
        (onnxruntime's run, MLX's eval), not between its steps."""
        while (first := self._wakeups.get()) is not None:
            jobs = list(first)
            while not self._wakeups.empty():
                more = self._wakeups.get()
                if more is None:
                    self._wakeups.put(None)
                    break
                jobs.extend(more)
            by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
            for job in jobs:
                by_loop.setdefault(job.loop, []).append(job)
            for loop, group in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_wake, group)
                except RuntimeError:  # the server's loop has closed (shutdown): nobody listens
                    for job in group:
                        job.cancelled.set()

    def _finish(self, slot: int, job: Job, reason: str) -> None:
        assert self.decoder is not None
        self.decoder.remove(slot)
        del self._active[slot]
        self._reserved_total -= self._reserved.pop(slot, 0)
        now = time.perf_counter()
        if reason == "cancelled":
            reason = job.ended_by
        else:
            self._end(job, reason)
        ttft = (job.t_first - job.t_submit) * 1e3 if job.t_first else float("nan")
        log.info("%s %s: prompt %d tok (cached %d), completion %d tok, ttft %.0f ms, "
                 "total %.0f ms", job.rid, reason, len(job.prompt), job.cached, job.generated,
                 ttft, (now - job.t_submit) * 1e3)
