"""`fuselm serve --draft-lookup`: speculative decoding with batching kept on. Concurrent greedy
requests get `fuselm run`'s greedy text (several tokens a row a step reach the right
requests, a request ending mid-step drops the tokens after its last), and a sampled request
beside them is served (plainly)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.serve.conftest import MODEL, Server
from tests.serve.test_serve import PROMPTS, fuselm_run


def test_speculative_batch_equals_fuselm_run(speculative_server: Server) -> None:
    srv = speculative_server
    asks = [(PROMPTS[i], n) for i, n in ((0, 12), (3, 20), (5, 7))]
    want = [fuselm_run(srv, p, n, raw=True)["text"] for p, n in asks]

    def complete(ask: tuple[str, int], temperature: float = 0) -> str:
        r = srv.client().completions.create(model=MODEL, prompt=ask[0], max_tokens=ask[1],
                                            temperature=temperature, seed=1)
        return r.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        sampled = pool.submit(complete, (PROMPTS[7], 10), 0.9)
        got = list(pool.map(complete, asks))
        assert isinstance(sampled.result(), str)
    assert got == want
    assert srv.health()["status"] == "ok"
