"""A request's first token goes to its reader once its prefill made it, before the batch's next
step (the scheduler's `_first_tokens`): requests that join together each get theirs after their
own prefill, a one-token request ends without a step, and the tokens are the step's own
(generate's greedy), the first not reported twice."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fuselm.converter.serve.decoder import ServeDecoder
from fuselm.converter.serve.scheduler import Job, Scheduler
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.sampling import SamplingOptions

PROMPTS = [list(range(4, 14)), list(range(40, 47)), list(range(90, 102))]
MAX_TOKENS = [1, 6, 1]


class TimedSteps(ServeDecoder):
    """The serve decoder, with the time each of its steps began and each prompt's add ended
    (the engine thread's clock)."""

    starts: list[float]
    added: dict[tuple[int, ...], float]

    def step(self) -> dict[int, list[int]]:
        self.starts.append(time.perf_counter())
        return super().step()

    def add(self, prompt_ids, sampling, **kw):  # noqa: ANN001, ANN003, ANN201
        slot = super().add(prompt_ids, sampling, **kw)
        self.added[tuple(prompt_ids)] = time.perf_counter()
        return slot


def test_first_tokens_go_out_before_the_next_step(serve_artifact: Path) -> None:
    engine = make_engine(serve_artifact, "mlx")
    want = [generate(engine, p, max_new_tokens=m).tokens for p, m in zip(
        PROMPTS, MAX_TOKENS, strict=True)]

    def build() -> TimedSteps:
        dec = TimedSteps(make_engine(serve_artifact, "mlx"), 4, 128)
        dec.starts, dec.added = [], {}
        return dec

    async def main() -> tuple[list[Job], TimedSteps]:
        loop = asyncio.get_running_loop()
        sched = Scheduler(build, lambda ids: "", eos_ids=[], max_batch=4)
        await loop.run_in_executor(None, sched.start)
        try:
            jobs = [Job(f"job{i}", p, SamplingOptions(), m, [], loop)
                    for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]
            sched.submit(*jobs)  # together: they join in one admission pass
            for job in jobs:
                while (await job.take())[1] is None:
                    pass
            assert isinstance(sched.decoder, TimedSteps)
            return jobs, sched.decoder
        finally:
            sched.stop()

    jobs, dec = asyncio.run(main())
    assert [j.tokens for j in jobs] == want
    assert all(j.finish == "length" for j in jobs)
    # no step between a prompt's prefill and its first token out; the one-token requests
    # ended with no step of theirs; the other's first step fed its first token (its report
    # skipped), the next 5 gave its 5 more
    for job in jobs:
        added = dec.added[tuple(job.prompt)]
        assert added <= job.t_first and not any(added <= s <= job.t_first for s in dec.starts)
    assert len(dec.starts) == 6
