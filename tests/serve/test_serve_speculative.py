"""`fuselm serve --draft-lookup`: speculative decoding with batching kept on. Concurrent greedy
requests get `fuselm run`'s greedy text (several tokens a row a step reach the right
requests, a request ending mid-step drops the tokens after its last), and a sampled request
beside them is served (plainly). On onnxruntime exact rows stay off there (they would unbatch
the rows) and are on with --max-batch 1."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serve.conftest import MODEL, Server, running_server
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
    engine = srv.health()["engine"]
    assert engine["exact_rows"] is False and "exact rows" not in engine["lowering"]  # batched


def test_one_request_at_a_time_asks_for_exact_rows(serve_artifact: Path,
                                                      tmp_path_factory: pytest.TempPathFactory
                                                      ) -> None:
    """`--max-batch 1 --draft-lookup`: exact rows asked for (nothing to unbatch); this model
    is not lowered (head_dim 24), so they are off, said so, and drafting still serves."""
    log = tmp_path_factory.mktemp("serve_spec_one") / "spec1.log"
    with running_server(serve_artifact, log, "onnxruntime",
                        ["--draft-lookup", "--max-batch", "1"]) as srv:
        engine = srv.health()["engine"]
        assert engine["exact_rows"] is False
        assert engine["lowering"].endswith("exact rows off (they need the lowered graph)")
        r = srv.client().completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8,
                                            temperature=0)
        assert r.choices[0].text and srv.health()["status"] == "ok"
