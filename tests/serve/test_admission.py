"""The scheduler's admission against the KV budget, in-process on MLX's block cache: a request
whose reservation (prompt + max_tokens, in whole blocks) does not fit next to the running ones
waits for them; one that waits past the queue timeout is refused with the numbers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from fuselm.converter.serve.decoder import ServeDecoder
from fuselm.converter.serve.scheduler import Job, OverBudget, Scheduler
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.kv_cache import BLOCK
from fuselm.runtime_metal.sampling import SamplingOptions

BIG = (list(range(4, 24)), 100)  # 20 + 100 tokens: 2 blocks reserved (one fed ahead)
SMALL = (list(range(30, 35)), 2)  # 1 block


def run(artifact: Path, kv_tokens: int | None, specs: list[tuple[list[int], int]],
        queue_timeout: float | None = None) -> list[Job]:
    """Submit the jobs in order to a scheduler over a fresh MLX decoder; wait for all."""

    async def main() -> list[Job]:
        loop = asyncio.get_running_loop()
        sched = Scheduler(lambda: ServeDecoder(make_engine(artifact, "mlx"), 4, 256,
                                               kv_tokens=kv_tokens),
                          lambda ids: "", eos_ids=[], max_batch=4, queue_timeout=queue_timeout)
        await loop.run_in_executor(None, sched.start)
        try:
            jobs = [Job(f"job{i}", p, SamplingOptions(), m, [], loop)
                    for i, (p, m) in enumerate(specs)]
            for job in jobs:
                sched.submit(job)
            for job in jobs:
                while (await job.take())[1] is None:
                    pass
            assert sched.kv_stats()["reserved_tokens"] == 0
            return jobs
        finally:
            sched.stop()

    return asyncio.run(main())


def finish_order(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split()[0] for r in caplog.records
            if r.name == "fuselm.serve" and ": prompt " in r.getMessage()]


def test_a_request_that_does_not_fit_waits_for_the_running_one(
        serve_artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fuselm.serve")
    # no budget beyond the slots: the short request joins at once and ends first
    free = run(serve_artifact, None, [BIG, SMALL])
    assert finish_order(caplog) == ["job1", "job0"]
    caplog.clear()
    # 2 blocks: the big request reserves both, the small one starts when it has left
    held = run(serve_artifact, 2 * BLOCK, [BIG, SMALL])
    assert finish_order(caplog) == ["job0", "job1"]
    assert [j.tokens for j in held] == [j.tokens for j in free]  # same greedy tokens
    assert all(j.finish == "length" and j.error is None for j in held)


def test_waiting_past_the_queue_timeout_is_a_503_with_the_numbers(serve_artifact: Path) -> None:
    big, small = run(serve_artifact, 2 * BLOCK, [BIG, SMALL], queue_timeout=0.01)
    assert big.finish == "length" and len(big.tokens) == 100
    assert small.finish == "error" and small.tokens == []
    status, message = small.error  # type: ignore[misc]
    assert status == 503 and "--queue-timeout 0.01" in message
    assert f"{2 * BLOCK} of {2 * BLOCK} are reserved by 1 running request" in message


def test_a_request_over_the_whole_budget_is_refused_at_once(serve_artifact: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sched = Scheduler(lambda: ServeDecoder(make_engine(serve_artifact, "mlx"), 4, 256,
                                               kv_tokens=2 * BLOCK),
                          lambda ids: "", eos_ids=[])
        await loop.run_in_executor(None, sched.start)
        try:
            with pytest.raises(OverBudget, match=f"needs {3 * BLOCK} KV cache tokens .* "
                               f"whole KV budget is {2 * BLOCK} tokens"):
                sched.submit(Job("x", list(range(4, 104)), SamplingOptions(), 40, [], loop))
        finally:
            sched.stop()

    asyncio.run(main())
