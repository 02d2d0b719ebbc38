"""Token delivery, on the server's event loop: a Job's token ids (appended by the engine
thread, scheduler.py) become text events for its response. Each turn takes every token that
arrived since the last one, runs them through the one text stream (runtime_metal/text_stream.py:
detokenizer and stop strings) and yields their text as one event; so a client that reads
slowly, or a loop busy with other streams, gets fewer, larger chunks while the engine keeps
its pace. After a chunk a stream takes no new tokens for CHUNK_INTERVAL_S (the end of the
request still wakes it at once): a fast engine would otherwise wake the event loop for every
token, and each wake-up is a GIL hand-over the engine thread waits on (the loop's Python runs
between the engine's steps). The first text goes out at once (time to first token). A stop
string ends the request here: the job is cancelled and the engine drops its row before the
next step. With tools, stop strings apply to the reply's text outside a tool call
(ContentStops): a call is never cut into content by a stop string its arguments hold.

Events: ("delta", text, logprobs), ("done", finish_reason, usage) or ("error", status,
message). A delta's logprobs are those of the tokens it took (sampling.TokenLogprobs; empty
unless the job asked for them): a delta may carry tokens whose text is still held back (a
character cut between tokens), and its text may end with the held text of earlier tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fuselm.converter.serve.scheduler import Job
from fuselm.runtime_metal.text_stream import Decode, StopMatcher, TextStream
from fuselm.runtime_metal.tool_calls import ToolFormat, call_opened, call_start, parse_reply

# Chunks per stream at most ~100/s: below what a reader notices, far above any engine's pace
# on a slow CPU (one token per chunk there), ~10 tokens per chunk at 1 ms a token.
CHUNK_INTERVAL_S = 0.01


class ContentStops:
    """TextStream's face (push, finish, stopped) for a reply that may make tool calls: stop
    strings are matched in the text before a call only, as OpenAI's and vLLM's apply `stop` to
    content. From a call's marker on, the text is held until the end: if it parses as calls of
    `names`, or max_tokens cut it (a call in progress), it is handed out whole; else it was
    content after all and the stop strings apply to it then."""

    def __init__(self, decode: Decode, stop: list[str], fmt: ToolFormat,
                 names: list[str]) -> None:
        self._text = TextStream(decode)
        self._stops = StopMatcher(stop)
        self.fmt, self.names = fmt, names
        self.full = ""  # the reply's text so far
        self.fed = 0  # how much of it the stop matcher has seen
        self.opened = False  # a call's marker has shown: the rest is held

    @property
    def stopped(self) -> bool:
        return self._stops.hit is not None

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.full += self._text.push(token)
        if self.opened:
            return ""
        at = call_opened(self.full, self.fmt)
        self.opened = at is not None
        if at is None:  # a tail that may grow into the marker waits
            at = call_start(self.full, self.fmt)
        return self._feed(len(self.full) if at is None else at)

    def finish(self, truncated: bool = False) -> str:
        """The text still held; `truncated`: max_tokens ended the reply."""
        if self.stopped:
            return ""
        self.full += self._text.finish()
        if self.opened and (truncated or parse_reply(self.full, self.fmt, self.names).calls):
            out, self.fed = self._stops.flush() + self.full[self.fed:], len(self.full)
            return out
        out = self._feed(len(self.full))
        return out if self.stopped else out + self._stops.flush()

    def _feed(self, upto: int) -> str:
        piece, self.fed = self.full[self.fed:upto], max(self.fed, upto)
        return self._stops.feed(piece)


def _usage(job: Job, completion: int) -> dict[str, int]:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion,
            "cached_tokens": job.cached}


async def deliver(job: Job, decode: Decode, interval: float = CHUNK_INTERVAL_S
                  ) -> AsyncIterator[tuple[Any, ...]]:
    text: TextStream | ContentStops = TextStream(decode, job.stop) if job.tool_format is None \
        else ContentStops(decode, job.stop, job.tool_format, job.tool_names)
    consumed = 0
    not_before = 0.0
    loop = asyncio.get_running_loop()
    while True:
        tokens, finish = await job.take(not_before)
        base = job.read - len(tokens)  # the first of them, in the job's tokens
        parts = []
        used = 0
        for token in tokens:
            consumed += 1
            used += 1
            parts.append(text.push(token))
            if text.stopped:
                break
        records = job.logprobs[base:base + used] if job.top_logprobs is not None else []
        if text.stopped:  # tokens the engine made past the stop string are dropped
            job.ended_by = "stop"
            job.cancelled.set()
            if (piece := "".join(parts)) or records:
                yield ("delta", piece, records)
            yield ("done", "stop", _usage(job, consumed))
            return
        if finish in ("error", "shutdown"):
            assert job.error is not None
            yield ("error", *job.error)
            return
        if finish is not None:
            parts.append(text.finish() if isinstance(text, TextStream) else
                         text.finish(truncated=finish == "length"))
        if (piece := "".join(parts)) or records:
            yield ("delta", piece, records)
            not_before = loop.time() + interval
        if finish is not None:
            # completion_tokens: what the engine generated (an EOS included)
            yield ("done", "stop" if text.stopped else finish, _usage(job, job.generated))
            return
