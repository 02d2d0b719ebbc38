"""One model over two ranks of mx.distributed's ring backend on 127.0.0.1 (processes started as
`mlx.launch -n 2 --backend ring` starts them): tensor and pipeline parallel give the single
rank's logits and greedy tokens (and the batch decoder's, rows joining and leaving; pipeline
in micro-batches, the ranks busy at once) for a Llama (untied head), a Qwen3 (q/k-norm, tied
head) and a Gemma 3 (sliding window, scaled embedding), float and Q4 (and the Qwen3 in
`--quant mixed`'s 6- and 8-bit blocks, its tied table at 6 bits); each rank
reads about half the weights; a rank killed mid-generation ends the other with one error line;
the server on rank 0 answers as a single-rank server does."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fuselm.converter.models.builtin import build_model
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.loaded_model import open_model
from tests.families import TEST_CONFIGS
from tests.runtime.conftest import convert, quantized_copy
from tests.runtime.parallel_worker import batch_tokens

PROMPT = [5, 9, 33, 7, 100, 2, 41, 17, 8, 300, 12, 77]
BATCH_PROMPTS = [[5, 9, 33, 7, 100], [3, 4, 200, 17, 8, 300, 12], [50, 60, 70],
                 [11, 12, 13, 14], [5, 9, 33, 8, 2, 6]]
BATCHED = "gemma3_text-q4"  # the batch decoder's rows (the server's path) on this one
NEW_TOKENS = 8
BATCH_STEPS = 12
KV4 = f"{BATCHED}-kv4-pipeline"  # BATCHED with a 4-bit KV cache, in a pipeline
# head_dim 32 and 128 MLP channels: each rank's rows of o_proj / down_proj are whole Q4 blocks
SPLITTABLE = {"head_dim": 32, "intermediate_size": 128}
FAMILIES = {"llama": {}, "qwen3": {}, "gemma3_text": TEST_CONFIGS["gemma3_text"]}
MODES = ("tensor", "pipeline")
JOB_S = 240


def _ports() -> int:
    """A free port whose successor is free too (rank r listens on base + r)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no two adjacent free ports")


def launch(argv: list[str], root: Path, ranks: int = 2, **popen: object
           ) -> list[subprocess.Popen]:
    """Start `argv` as `ranks` ranks of a ring on 127.0.0.1: mlx.launch's environment (a
    hostfile, MLX_RANK) without its process tree, so a test can kill one rank."""
    base = _ports()
    hostfile = root / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(ranks)]))
    return [subprocess.Popen(argv, env={**os.environ, "MLX_RANK": str(r),
                                        "MLX_HOSTFILE": str(hostfile)}, **popen)  # type: ignore[arg-type]
            for r in range(ranks)]


SIX = "qwen3-q6"  # --quant mixed under a budget that gives 6- and 8-bit blocks


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{family}-{float|q4} (and SIX) -> artifact."""
    root = tmp_path_factory.mktemp("parallel_models")
    out = {}
    for family, extra in FAMILIES.items():
        hf = build_model(root / f"{family}_hf", family, seed=3, **{**extra, **SPLITTABLE})
        art = convert(hf, root / f"{family}_float")
        out[f"{family}-float"] = art
        out[f"{family}-q4"] = quantized_copy(art, root / f"{family}_q4", lm_head=True,
                                             embeddings=True)
    out[SIX] = convert(root / "qwen3_hf", root / "qwen3_q6", quant="mixed", bits_budget=6.8,
                       default_calibration=False)
    return out


@pytest.fixture(scope="module")
def single(artifacts: dict[str, Path]) -> dict[str, dict]:
    """One rank: each artifact's prompt logits, greedy tokens and weight bytes."""
    out = {}
    for name, art in artifacts.items():
        model = open_model(art, "mlx")
        logits = model.engine.forward(np.array(PROMPT), all_logits=True)
        model.engine.reset()
        out[name] = {"logits": logits, "weight_bytes": model.engine.weight_bytes,
                     "tokens": generate(model.engine, PROMPT, max_new_tokens=NEW_TOKENS).tokens}
        if name == BATCHED:
            out[name]["batch"] = batch_tokens(model.engine, BATCH_PROMPTS, BATCH_STEPS)[0]
            kv4 = open_model(art, "mlx", kv_bits=4, kv_group_size=32).engine
            out[KV4] = {"batch": batch_tokens(kv4, BATCH_PROMPTS, BATCH_STEPS)[0]}
    return out


@pytest.fixture(scope="module")
def job(artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case in one two-rank job (one launch: the import and group setup paid once)."""
    root = tmp_path_factory.mktemp("parallel_job")
    cases = [{"name": f"{name}-{mode}", "artifact": str(art), "mode": mode,
              "batch": name == BATCHED}
             for name, art in artifacts.items() for mode in MODES]
    cases.append({"name": KV4, "artifact": str(artifacts[BATCHED]), "mode": "pipeline",
                  "batch": True, "options": {"kv_bits": 4, "kv_group_size": 32}})
    spec = root / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "prompt": PROMPT, "new_tokens": NEW_TOKENS,
                                "batch_prompts": BATCH_PROMPTS, "batch_steps": BATCH_STEPS}))
    worker = Path(__file__).with_name("parallel_worker.py")
    procs = launch([sys.executable, str(worker), str(spec), str(root)], root,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [p.communicate(timeout=JOB_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return root


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [f"{f}-{q}" for f in FAMILIES for q in ("float", "q4")]
                         + [SIX])
def test_two_ranks_match_one(job: Path, single: dict[str, dict], name: str, mode: str) -> None:
    ranks = [json.loads((job / f"rank{r}.json").read_text()) for r in (0, 1)]
    ref = single[name]
    for r in ranks:  # every rank generated the single rank's tokens
        assert r[f"{name}-{mode}"]["tokens"] == ref["tokens"]
        if name == BATCHED:  # and the batch decoder's, rows joining and leaving mid-way
            assert r[f"{name}-{mode}"]["batch"] == ref["batch"]
            described = r[f"{name}-{mode}"]["batch_decoder"]
            if mode == "pipeline":  # in micro-batches, one per rank, each rank busy at once
                assert described["micro_batches"] == 2
                assert described["pipeline_full_slots"] > described["pipeline_slots"] / 3
    logits = np.load(job / f"{name}-{mode}.npy")
    rel = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    # pipeline moves the hidden state bit for bit; tensor adds partial sums in another order
    assert rel <= (0.0 if mode == "pipeline" else 1e-5), rel
    # each rank reads about half the weights (tensor: every weight's slice; pipeline: its
    # layers, and a tied table on both ends)
    if mode == "tensor" or name.startswith("llama"):
        for r in ranks:
            share = r[f"{name}-{mode}"]["weight_bytes"] / ref["weight_bytes"]
            assert 0.45 <= share <= 0.56, share


def test_pipeline_micro_batches_over_4bit_keys(job: Path, single: dict[str, dict]) -> None:
    """A 4-bit KV cache (keys per channel: each row's tail slot in its block table) in a
    pipeline's micro-batches: every rank's batch decoder gives the single rank's tokens."""
    for r in (0, 1):
        got = json.loads((job / f"rank{r}.json").read_text())[KV4]
        assert got["batch"] == single[KV4]["batch"]
        assert got["batch_decoder"]["mode"] == "batched"
        assert got["batch_decoder"]["micro_batches"] == 2


def test_dead_rank_ends_the_job(artifacts: dict[str, Path], tmp_path: Path) -> None:
    """`fuselm run --parallel` (the CLI, as mlx.launch starts it): rank 1 killed mid-generation;
    rank 0 exits within 30 s with one error line naming what happened, no traceback."""
    argv = [sys.executable, "-m", "fuselm.converter.cli.main", "run",
            str(artifacts["llama-float"]), "--prompt-ids", "1,2,3", "-n", "500",
            "--parallel", "pipeline"]
    procs = launch(argv, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert procs[0].stdout is not None
        first = procs[0].stdout.read(1)  # generating: text is coming
        assert first, procs[0].communicate(timeout=30)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 2
    text = err.decode()
    assert "Traceback" not in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: rank 0: another rank of the distributed job stopped"), text


def _wait_health(url: str, procs: list[subprocess.Popen], deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a server process exited"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not come up")


def test_server_on_rank_0(artifacts: dict[str, Path], tmp_path: Path) -> None:
    """`fuselm serve --parallel tensor` over two ranks answers the openai client with the text
    of a single-rank server; a rank killed afterwards shows on rank 0's /health (503, the
    reason) within 30 s, and a request then gets 503."""
    import httpx
    import openai

    art = artifacts["qwen3-float"]
    base = [sys.executable, "-m", "fuselm.converter.cli.main", "serve", str(art),
            "--max-context", "128", "--max-batch", "2", "--log-level", "warning"]
    one_port, job_port = _ports(), _ports() + 100
    log = (tmp_path / "serve.log").open("wb")
    procs = [subprocess.Popen([*base, "--port", str(one_port), "--engine", "mlx"],
                              stdout=log, stderr=subprocess.STDOUT)]
    procs += launch([*base, "--port", str(job_port), "--parallel", "tensor"], tmp_path,
                    stdout=log, stderr=subprocess.STDOUT)
    urls = [f"http://127.0.0.1:{one_port}", f"http://127.0.0.1:{job_port}"]
    try:
        deadline = time.monotonic() + JOB_S
        for url in urls:
            _wait_health(url, procs, deadline)
        texts = []
        for url in urls:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                   timeout=60)
            chat = client.chat.completions.create(
                model=art.name, messages=[{"role": "user", "content": "hello world"}],
                max_tokens=NEW_TOKENS, temperature=0)
            done = client.completions.create(model=art.name, prompt="The quick brown fox",
                                             max_tokens=NEW_TOKENS, temperature=0)
            texts.append((chat.choices[0].message.content, done.choices[0].text))
        assert texts[0] == texts[1] and all(texts[0])
        # logprobs and n choices reach the other rank; a grammar does not (its state lives on
        # rank 0 only): refused by name, the client's error
        both = [httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": art.name, "messages": [{"role": "user", "content": "hello world"}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2}
        ).json() for url in urls]
        for one, two in zip(both[0]["choices"], both[1]["choices"], strict=True):
            assert one["message"] == two["message"]  # tensor-parallel logits: within 1e-5
            lp1, lp2 = ([t["logprob"] for t in c["logprobs"]["content"]] for c in (one, two))
            assert np.allclose(lp1, lp2, atol=1e-4) and len(lp1) == 4
        shaped = httpx.post(urls[1] + "/v1/chat/completions", timeout=60, json={
            "model": art.name, "messages": [{"role": "user", "content": "hello world"}],
            "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert shaped.status_code == 400, shaped.text
        assert shaped.json()["error"]["type"] == "invalid_request_error"
        assert "--parallel" in shaped.json()["error"]["message"]
        procs[2].send_signal(signal.SIGKILL)  # rank 1 of the job
        t0 = time.monotonic()
        while (health := httpx.get(urls[1] + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() - t0 < 30, "the lost rank did not show on /health"
            time.sleep(0.5)
        assert health.status_code == 503
        assert health.json()["error"].startswith("rank 0: another rank of the distributed job")
        late = httpx.post(urls[1] + "/v1/completions", timeout=10,
                          json={"model": art.name, "prompt": "hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_lost"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        log.close()


def test_inspect_says_how_an_artifact_splits(artifacts: dict[str, Path], q4_artifact: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """`fuselm inspect OUT --parallel MODE -n N`: each rank's weight bytes where the split
    works (exit 0), the reason where it does not (exit 1): KV heads that do not divide, Q4
    blocks a row split would cut (head_dim 24: a rank's 48 rows of o_proj are 1.5 blocks)."""
    from tests.cli_run import run_cli

    art = artifacts["llama-q4"]
    code, out, _ = run_cli(capsys, "inspect", str(art), "--parallel", "tensor", "-n", "2",
                           "--json")
    facts = json.loads(out)
    assert code == 0 and facts["splits"] and len(facts["rank_weight_bytes"]) == 2
    for share in facts["rank_weight_bytes"]:
        assert 0.45 <= share / facts["weight_bytes"] <= 0.56
    code, out, _ = run_cli(capsys, "inspect", str(art), "--parallel", "pipeline", "-n", "2")
    assert code == 0 and "layers 0-0" in out and "layers 1-1" in out
    code, out, _ = run_cli(capsys, "inspect", str(art), "--parallel", "tensor", "-n", "4")
    assert code == 1 and "2 KV heads do not divide over 4 ranks" in out
    code, out, _ = run_cli(capsys, "inspect", str(q4_artifact), "--parallel", "tensor")
    assert code == 1 and "quantization blocks" in out
