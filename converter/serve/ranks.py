"""`fuselm serve --parallel`: rank 0 serves HTTP; every other rank follows its batch schedule.

Rank 0's scheduler drives a `LeaderDecoder`: each call that changes the batch (add a request,
step, remove, reset) is first broadcast to the other ranks (runtime_metal/parallel.py's
broadcast_json), which make the same call on their own decoder (`follow`), so every rank runs
the same steps on the same sequences and its collectives meet their partners. A request that
leaves its seed open gets one on rank 0 before the broadcast: each rank then samples the same
tokens. While no request runs, rank 0 pings the others every few seconds, so a rank that dies
is noticed even when idle: the scheduler stops with one error line, /health answers 503 with
it, and new requests get 503.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fuselm.converter.serve.decoder import ServeDecoder
from fuselm.converter.serve.scheduler import EngineLost
from fuselm.runtime_metal.constraint import TokenConstraint
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.parallel import broadcast_json, peer_lost, peer_lost_message
from fuselm.runtime_metal.sampling import SamplingOptions, TokenLogprobs

log = logging.getLogger("fuselm.serve")
PING_S = 2.0  # an idle leader's ping interval: a dead rank is seen within it
T = TypeVar("T")


def _guarded(call: Callable[[], T]) -> T:
    """A collective that lost its partner becomes EngineLost (one line, no traceback)."""
    try:
        return call()
    except RuntimeError as e:
        if peer_lost(e):
            raise EngineLost(peer_lost_message(e)) from None
        raise


class LeaderDecoder:
    """Rank 0's decoder: the scheduler's calls, broadcast before they run here."""

    def __init__(self, inner: ServeDecoder) -> None:
        self.inner = inner
        self._sent = time.monotonic()

    def _send(self, message: dict[str, Any]) -> None:
        _guarded(lambda: broadcast_json(message, 0))
        self._sent = time.monotonic()

    # What the scheduler reads of its decoder without changing it: rank 0's own.
    @property
    def max_batch(self) -> int:
        return self.inner.max_batch

    @property
    def kv_budget(self) -> int:
        return self.inner.kv_budget

    @property
    def kv_window(self) -> int | None:
        return self.inner.kv_window

    @property
    def exhausted(self) -> set[int]:
        return self.inner.exhausted

    def kv_cost(self, tokens: int) -> int:
        return self.inner.kv_cost(tokens)

    def kv_held(self) -> int:
        return self.inner.kv_held()

    def memory(self) -> dict[str, int]:
        return self.inner.memory()

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        return self.inner.logprobs(slot)

    def first_token(self, slot: int) -> int:
        return self.inner.first_token(slot)

    def add(self, prompt_ids: Sequence[int], sampling: SamplingOptions, *,
            top_logprobs: int | None = None, fork_of: int | None = None,
            constraint: TokenConstraint | None = None) -> int:
        if constraint is not None:  # its grammar state lives on rank 0 only
            raise RuntimeUserError("response_format and tool_choice constraints are not "
                                   "supported by a --parallel server")
        if sampling.seed is None:  # one seed for every rank's sampler
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(62))
        wire = json.loads(json.dumps(dataclasses.asdict(sampling)))
        if _sampling(wire) != sampling:  # the ranks would sample differently
            raise RuntimeUserError("these sampling options do not reach the other ranks of a "
                                   "--parallel server unchanged; leave out the extended ones")
        self._send({"op": "add", "prompt": list(prompt_ids), "sampling": wire,
                    "top_logprobs": top_logprobs, "fork_of": fork_of})
        return _guarded(lambda: self.inner.add(prompt_ids, sampling, top_logprobs=top_logprobs,
                                               fork_of=fork_of))

    def step(self) -> dict[int, list[int]]:
        self._send({"op": "step"})
        return _guarded(self.inner.step)

    def remove(self, slot: int) -> None:
        self._send({"op": "remove", "slot": slot})
        _guarded(lambda: self.inner.remove(slot))

    def reset(self) -> None:
        self._send({"op": "reset"})
        _guarded(self.inner.reset)

    def cached_tokens(self, slot: int) -> int:
        return self.inner.cached_tokens(slot)

    def idle(self) -> None:
        if time.monotonic() - self._sent >= PING_S:
            self._send({"op": "ping"})

    def stop(self) -> None:
        """The job ends: the followers return (a follower already gone is no error here)."""
        try:
            self._send({"op": "stop"})
        except EngineLost:
            pass

    def describe(self) -> dict[str, object]:
        return self.inner.describe()


def _sampling(wire: dict[str, Any]) -> SamplingOptions:
    """SamplingOptions from their JSON form (logit_bias: pairs, as JSON lists)."""
    bias = tuple((int(t), float(b)) for t, b in wire.get("logit_bias", ()))
    return SamplingOptions(**{**wire, "logit_bias": bias})


def follow(decoder: ServeDecoder, rank: int) -> None:
    """A rank other than 0: rank 0's calls, in its order, until it stops."""
    while True:
        try:
            if not _follow_one(decoder, broadcast_json(None, rank)):
                return
        except RuntimeError as e:
            if peer_lost(e):
                raise RuntimeUserError(peer_lost_message(e)) from None
            raise


def _follow_one(decoder: ServeDecoder, message: dict[str, Any]) -> bool:
    """Make rank 0's call here; False once it says stop."""
    op = message["op"]
    if op == "add":
        try:  # rank 0 refused it too (a 400 there): the same state here
            decoder.add(message["prompt"], _sampling(message["sampling"]),
                        top_logprobs=message.get("top_logprobs"), fork_of=message.get("fork_of"))
        except RuntimeUserError:
            pass
    elif op == "step":
        decoder.step()
    elif op == "remove":
        decoder.remove(message["slot"])
    elif op == "reset":
        decoder.reset()
    return op != "stop"
