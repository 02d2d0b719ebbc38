"""fuselm's fused CUDA kernels (cuda_kernels/sources.py) against the fused-op contract's
NumPy references, and the compiled program with them on against it with them off.

The kernel tests need MLX's CUDA backend (they ran on an H200, see BENCHMARKS.md); on other
machines they are reported as skipped for that reason. The mode switch and the pairing of
steps (which the plain path runs on every machine) are tested everywhere."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fuselm.config import RuntimeConfig, resolve
from fuselm.passes.ops import fused_rope_reference, rms_norm_reference
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.validate import rel
from tests.runtime.conftest import convert, joined_rows_equal_generate

cuda = pytest.mark.skipif(not kernels.cuda_device(), reason="needs MLX's CUDA backend")
TOL = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def rounded(a: np.ndarray, dtype: mx.Dtype) -> tuple[mx.array, np.ndarray]:
    """The device array in `dtype` and its exact values back in float32."""
    x = mx.array(a.astype(np.float32)).astype(dtype)
    return x, np.array(x.astype(mx.float32))


# ---- everywhere: the switch and the pairing ----------------------------------------------------

def test_mode_switch() -> None:
    assert kernels.enabled("off") is False
    assert kernels.enabled("auto") is kernels.cuda_device()
    if not kernels.cuda_device():
        with pytest.raises(RuntimeUserError, match="needs MLX's CUDA backend"):
            kernels.enabled("on")


def test_auto_splits() -> None:
    """FUSELM_ATTN_SPLIT=auto (the default): as many key splits as fill the H200's blocks, at
    most one per 64 cache slots and MAX_SPLITS."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    assert kernels.auto_splits(4096, 8, 1) == 32  # Qwen3-0.6B: 8 KV heads, 2 q heads a block
    assert kernels.auto_splits(4096, 32, 1) == 8
    assert kernels.auto_splits(256, 8, 1) == 4  # a short cache: 64 slots a split at least
    assert kernels.auto_splits(32, 8, 1) == 1
    # a block serves as many query heads of a KV head as a lane's 16 floats hold
    assert kernels_cuda.split_heads_per_block(16, 8, 128) == 2
    assert kernels_cuda.split_heads_per_block(32, 8, 64) == 4
    assert kernels_cuda.split_heads_per_block(32, 4, 128) == 4
    assert kernels_cuda.split_heads_per_block(6, 2, 96) == 3
    assert kernels_cuda.split_heads_per_block(8, 1, 256) == 2


def test_cuda_graph_ops_set_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX_MAX_OPS_PER_BUFFER: set to the configuration's count (60, or the user's own value)
    on MLX's CUDA backend only (Metal reads the same variable for another purpose)."""
    import os

    env = "MLX_MAX_OPS_PER_BUFFER"
    monkeypatch.setenv(env, "")  # recorded: restored after the test
    monkeypatch.delenv(env)
    kernels.configure(resolve({}))
    assert os.environ.get(env) == ("60" if kernels.cuda_device() else None)
    monkeypatch.delenv(env, raising=False)
    kernels.configure(resolve({env: "7"}))
    assert os.environ.get(env) == ("7" if kernels.cuda_device() else None)


def test_compact_cuda_drops_comments_and_indentation_only() -> None:
    """What MLX hashes at every launch: comments, indentation and blank lines go; code, line
    breaks (preprocessor lines stay whole) and a `//` inside a string literal stay."""
    text = ("// a comment line\n"
            "#define N 4  // why four\n"
            "\n"
            "  __device__ int f(int x) {   // trailing\n"
            '    asm volatile("// not a comment" ::);\n'
            "    return x * N;\n"
            "  }\n")
    assert kernels.compact_cuda(text) == (
        "#define N 4\n__device__ int f(int x) {\n"
        'asm volatile("// not a comment" ::);\nreturn x * N;\n}\n')


def test_kernels_are_made_only_through_cuda_kernel() -> None:
    """Every fused kernel reaches mx.fast.cuda_kernel through kernels.cuda_kernel (compact
    text); benchmarks/cuda_compile_check.py --compare-ptx checks that the PTX is unchanged."""
    runtime = Path(kernels.__file__).parents[1]
    direct = [p.name for p in runtime.rglob("*.py")
              if p != Path(kernels.__file__) and "mx.fast.cuda_kernel(" in p.read_text()]
    assert direct == []
    made = [p.name for p in runtime.rglob("*.py") if "kernels.cuda_kernel(" in p.read_text()]
    assert sorted(made) == ["embedding.py", "q4_gemv.py", "sources.py"]


def test_program_pairs_every_layer(qwen3_artifact: Path) -> None:
    """Each layer's FusedRoPE+Attention is one op, and each residual Add with the RMSNorm after
    it: 2 per layer (the first layer's input norm reads the embedding, the last Add feeds the
    final norm)."""
    from fuselm.runtime_metal.engine import make_engine

    engine = make_engine(qwen3_artifact, "mlx")
    program = engine.fast.program
    kinds = collections.Counter(o.kind for o in program.ops)
    layers = program.num_layers
    assert kinds["rope_attention"] == layers and kinds["add_norm"] == 2 * layers
    assert kinds["rope"] == kinds["attention"] == 0


def test_fits_refuses_what_the_kernel_cannot_take() -> None:
    q = mx.zeros((1, 1, 4 * 64))
    kv = mx.zeros((1, 1, 2 * 64))
    cache = mx.zeros((1, 2, 256, 64))
    assert kernels.rope_attend_fits(q, kv, kv, (None, None), cache, cache, 4, 2, 64, 64)
    odd = mx.zeros((1, 2, 256, 24))
    assert not kernels.rope_attend_fits(mx.zeros((1, 1, 96)), mx.zeros((1, 1, 48)),
                                        mx.zeros((1, 1, 48)), (None, None), odd, odd,
                                        4, 2, 24, 24)  # head_dim not a multiple of 32
    assert not kernels.rope_attend_fits(mx.zeros((1, 2, 256)), mx.zeros((1, 2, 128)),
                                        mx.zeros((1, 2, 128)), (None, None), cache, cache,
                                        4, 2, 64, 64)  # two tokens: prefill keeps MLX's SDPA
    assert not kernels.add_rms_norm_fits(mx.zeros((1, 8)), mx.zeros((8,)), mx.ones((8,)), -1)


def test_gemv_fits_four_and_eight_bit_weights_of_their_width() -> None:
    """The GEMV takes 4-bit (K / 8 words a row) and 8-bit (K / 4) weights, each only at its
    own packed width; other widths (MLX's 2/3/5/6-bit forms) go to MLX's quantized matmul."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4

    x, s = mx.zeros((1, 1, 256), mx.float16), mx.zeros((64, 8), mx.float16)
    for bits in (4, 8):
        packed = mx.zeros((64, 256 * bits // 32), mx.uint32)
        assert kernels_q4.fits(x, packed, s, 32, bits, True)
        assert not kernels_q4.fits(x, packed, s, 32, 12 - bits, True)  # the other width
    assert not kernels_q4.fits(x, mx.zeros((64, 48), mx.uint32), s, 32, 6, True)


def test_float_bits_round_trips_kernel_constants() -> None:
    """Float constants go to the kernels as the int of their float32 bits (a template argument,
    not an input array): read back as float32 (the kernel's __int_as_float), each is the
    float32 the input array held. MLX writes template values into the kernel's name, so a
    set sign bit (a minus sign), infinity and NaN are refused."""
    for x in (1e-6, 1e-5, 1 / np.sqrt(128), 1 / np.sqrt(64), 1.0, 1.2, 0.0, 3.0e38):
        bits = kernels.float_bits(x)
        assert isinstance(bits, int) and 0 <= bits < 2**31
        back = np.array([bits], np.int32).view(np.float32)[0]
        assert back.tobytes() == np.float32(x).tobytes()
        assert back == np.array(mx.array([x], mx.float32))[0]
        assert kernels.takes_float_bits(x)
    for bad in (-1e-6, -1.0, -0.0, float("inf"), float("nan"), 1e39):
        assert not kernels.takes_float_bits(bad)
        with pytest.raises(ValueError):
            kernels.float_bits(bad)


@pytest.mark.parametrize("norms", [False, True])  # Llama (no q/k-norm), Qwen3
@pytest.mark.parametrize("splits", [0, 1, 8])
def test_attention_launch_takes_no_constant_or_duplicate_input(launches: list, norms: bool,
                                                               splits: int) -> None:
    """Everywhere (no launch): with a fused projection the attention launch takes it once, k
    and v aliasing it in the body; absent q/k-norm scales are no inputs; eps and the two
    scales are template constants. Llama: 10 -> 5 inputs a layer, Qwen3: 10 -> 7 (MLX-CUDA's
    host cost ~0.4 µs an input). Every name the body reads is an input or set before use."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    d, hq, hk = 64, 8, 2
    qkv = mx.zeros((1, 1, (hq + 2 * hk) * d), mx.float16)
    q, k, v = qkv[..., :hq * d], qkv[..., hq * d:(hq + hk) * d], qkv[..., (hq + hk) * d:]
    n = mx.ones((d,), mx.float16) if norms else None
    cache = mx.zeros((1, hk, 256, d), mx.float16)
    inv = mx.zeros((d // 2,), mx.float32)
    prm = (1e-6, 1 / np.sqrt(d), 1.0)
    for joined in (qkv, None):
        kernels_cuda.rope_attend(q, k, v, n, n, inv, prm, mx.array([5], mx.int32), cache, cache,
                                 hq=hq, hk=hk, rotary_dim=d, interleaved=False, splits=splits,
                                 qkv=joined)
    (fused, apart) = launches
    norm_names = ["qn", "kn"] if norms else []
    assert fused["input_names"] == ["q", *norm_names, "inv_freq", "offset", "kc", "vc"]
    assert apart["input_names"] == ["q", "k", "v", *norm_names, "inv_freq", "offset", "kc",
                                    "vc"]
    assert fused["name"] != apart["name"]
    assert [r["inputs"] for r in launches] == [len(r["input_names"]) for r in launches]
    for r in launches:
        src = str(r["source"])
        assert "prm" not in src
        for name in ("k", "v", "qn", "kn"):
            if name not in r["input_names"]:  # declared by the prelude, before any use
                decl = src.index(f"const T* {name} = ")
                use = re.search(rf"\b{name}\[", src)
                assert use is not None and decl < use.start()
        assert r["template"]["PE"] == kernels.float_bits(1e-6)  # type: ignore[index]
        assert r["template"]["PQ"] == kernels.float_bits(1 / np.sqrt(d))  # type: ignore[index]
        assert r["template"]["PA"] == kernels.float_bits(1.0)  # type: ignore[index]


def test_add_norm_launches_take_eps_as_a_constant(launches: list) -> None:
    """Everywhere (no launch): the add+norm GEMV (6 inputs, was 7) and the separate
    add+RMSNorm (3, was 4) take eps as the template constant EPSB; an eps it cannot be
    (negative) leaves QWeight.matmul_add_norm to the plain path (None)."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
    from fuselm.runtime_metal.mlx_engine import qweight

    x, r = mx.zeros((1, 1, 256), mx.float16), mx.zeros((1, 1, 128), mx.float16)
    packed, sc = mx.zeros((128, 32), mx.uint32), mx.zeros((128, 8), mx.float16)
    w = mx.ones((128,), mx.float16)
    hy = kernels_q4.q4_gemv_add_norm(x, packed, sc, sc, 32, r, w, 1e-5)
    kernels_cuda.add_rms_norm(r, r, w, 1e-5)
    assert [r_["inputs"] for r_ in launches] == [6, 3]
    # h and y: ONE output [2, ...] (MLX-CUDA's host cost is ~2.1 µs an output array)
    assert launches[0]["output_names"] == ["hy"]
    assert hy.shape == (2, 1, 1, 128)
    for r_ in launches:
        assert "eps" not in r_["input_names"]  # type: ignore[operator]
        assert r_["template"]["EPSB"] == kernels.float_bits(1e-5)  # type: ignore[index]
    wq, _ = _q4_weight(np.random.default_rng(0), 256, 128, 32)
    with qweight.gemv_kernel():
        assert wq.matmul_add_norm(x, r, w, -1e-5) is None
        assert wq.matmul_add_norm(x, r, w, 1e-5) is not None
    assert len(launches) == 3


def test_add_norm_rows_are_read_out_of_its_one_output(launches: list) -> None:
    """Everywhere (no launch): QWeight.matmul_add_norm's h and y are views of the launch's one
    output hy [2, rows, 1, N]; a GEMV reading y (plain, gated, float32-out) or an add+norm
    taking h as its residual gets hy itself and the view's element offset (XO = rows x N for
    y, RO = 0 for h), a view of no add+norm (or outside gemv_kernel) its own array at 0.
    The registry empties when gemv_kernel ends."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.mlx_engine import qweight

    rng = np.random.default_rng(0)
    rows, k, n = 3, 256, 128
    w, _ = _q4_weight(rng, k, n, 32)
    w2, _ = _q4_weight(rng, n, 256, 32)
    x, r = mx.zeros((rows, 1, k), mx.float32), mx.zeros((rows, 1, n), mx.float32)
    scale = mx.ones((n,), mx.float32)
    with qweight.gemv_kernel():
        hy_views = w.matmul_add_norm(x, r, scale, 1e-6)
        assert hy_views is not None and qweight.packed_pending() == 2
        h, y = hy_views
        (first,) = launches
        hy = first["outputs"][0]
        assert hy.shape == (2, rows, 1, n) and h.shape == y.shape == (rows, 1, n)
        assert first["arrays"][0] is x and first["arrays"][4] is r
        assert (first["template"]["XO"], first["template"]["RO"]) == (0, 0)
        w2.matmul(y)
        w2.gated_matmul(y, "silu")
        with qweight.float32_result():
            w2.matmul(y)
        w2.matmul(r)  # no view: its own array
        w.matmul_add_norm(x, h, scale, 1e-6)
        assert launches[-1]["arrays"][0] is not hy
    assert qweight.packed_pending() == 0
    gemvs = launches[1:4]
    for g in gemvs:
        assert g["name"] == "fuselm_q4_gemv"
        assert g["arrays"][0] is hy and g["template"]["XO"] == rows * n
    assert launches[4]["arrays"][0] is r and launches[4]["template"]["XO"] == 0
    (a,) = launches[5:]  # the next add+norm: h as the residual
    assert a["arrays"][4] is hy and a["template"]["RO"] == 0
    assert a["arrays"][0] is x and a["template"]["XO"] == 0
    assert a["name"] == "fuselm_q4_gemv_addnorm"
    # outside gemv_kernel nothing is registered: the plain path reads its inputs
    assert qweight._packed_source(y) is None
    assert kernels_q4.y_offset(hy) == rows * n


@pytest.fixture(scope="module")
def q4_kernel_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q4 Qwen3 whose decode step the kernels take whole (head_dim 64: the attention kernel
    fits, so its q/k/v are no slices either): _q4_qwen3."""
    return _q4_qwen3(tmp_path_factory.mktemp("q4_kernels"), seed=3)


def test_q4_decode_step_reads_add_norm_rows_without_slices(q4_kernel_artifact: Path,
                                                           linked_launches: list,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Everywhere (the launches recorded, outputs zeros that read their inputs): a Q4 decode
    step built with the kernels on has no Slice or Gather node in its graph (each costs MLX
    host time a step): every add+norm launch has one output hy, and the GEMVs reading its
    rows take hy itself, y at XO = N (one row) and h as the next add+norm's residual at RO =
    0: each layer's gate/up, the next layer's q/k/v and the LM head read y so, every add+norm
    but the first (whose residual is the embedding) h."""
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.mlx_engine import qweight
    from fuselm.runtime_metal.mlx_engine.decode import DecodeProgram

    engine = make_engine(q4_kernel_artifact, "mlx")  # on CPU: kernels off, the caches to run with
    # the program's kernel path on this machine: MLX's CUDA device claimed, launches recorded
    monkeypatch.setattr(kernels, "cuda_device", lambda: True)
    program = DecodeProgram.build(engine.plan, RuntimeConfig(kernels="on"))
    assert program.kernels and program.fold_norm
    engine.reserve(8)
    kv = [a for c in engine.fast.caches for a in c.buffers()]
    outs = program(mx.array(7, mx.int32), mx.array(3, mx.int32), *kv)
    assert qweight.packed_pending() == 0
    dot = q4_kernel_artifact.parent / "step.dot"
    mx.export_to_dot(str(dot), *outs)
    labels = collections.Counter(re.findall(r'label\s*=\s*"([^"]*)"', dot.read_text()))
    assert labels["Sum"] > 0  # the recorder's edges are in the graph
    assert labels["Slice"] == labels["Gather"] == 0
    layers = program.num_layers
    made = [r for r in linked_launches if r["name"] == "fuselm_q4_gemv_addnorm"]
    assert len(made) == 2 * layers
    hys = {id(r["outputs"][0]): r for r in made}
    for r in made:
        assert r["output_names"][0] == "hy" and r["outputs"][0].shape[0] == 2
    n = made[0]["template"]["NO"]
    residual_reads = [r for r in made if id(r["arrays"][4]) in hys]
    assert len(residual_reads) == 2 * layers - 1
    assert all(r["template"]["RO"] == 0 for r in made)
    y_reads = [r for r in linked_launches
               if r["name"] == "fuselm_q4_gemv" and id(r["arrays"][0]) in hys]
    assert len(y_reads) == 2 * layers
    assert all(r["template"]["XO"] == n for r in y_reads)
    others = [r for r in linked_launches
              if r["name"] == "fuselm_q4_gemv" and id(r["arrays"][0]) not in hys]
    assert others and all(r["template"]["XO"] == 0 for r in others)


# ---- MLX-CUDA: each kernel against the contract's references -----------------------------------

@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 1024), (1, 2048), (7, 96), (3, 5000)])
def test_add_rms_norm_kernel(dtype: mx.Dtype, rows: int, hidden: int) -> None:
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    rng = np.random.default_rng(rows * hidden)
    x, xf = rounded(rng.normal(size=(1, rows, hidden)), dtype)
    r, rf = rounded(rng.normal(size=(1, rows, hidden)) * 3, dtype)
    w, wf = rounded(rng.uniform(0.5, 1.5, hidden), dtype)
    h, y = kernels_cuda.add_rms_norm(x, r, w, 1e-6)
    _, h_ref = rounded(xf + rf, dtype)
    assert rel(np.array(h.astype(mx.float32)), h_ref) <= TOL[dtype]
    y_ref = rms_norm_reference(h_ref, wf, 1e-6)
    assert rel(np.array(y.astype(mx.float32)), y_ref) <= TOL[dtype]


def _attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float
                         ) -> np.ndarray:
    """q [hq, d], keys/values [hk, n, d] -> [hq * d], float64 softmax, GQA by head groups."""
    hq, hk = q.shape[0], keys.shape[0]
    out = []
    for h in range(hq):
        g = h // (hq // hk)
        s = keys[g].astype(np.float64) @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out.append(p @ values[g].astype(np.float64) / p.sum())
    return np.concatenate(out)


ROPE_CASES = [
    # d, hq, hk, q/k-norm, interleaved, rotary fraction, attention scale, position
    (128, 16, 8, True, False, 1.0, 1.0, 517),  # Qwen3-0.6B's attention
    (64, 32, 8, False, False, 1.0, 1.0, 640),  # Llama-3.2-1B's
    (64, 4, 4, False, True, 1.0, 1.0, 3),  # MHA, GPT-J-style pairs
    (128, 8, 1, True, False, 0.5, 1.2, 1500),  # MQA, partial rotary, YaRN-style scale
    (256, 4, 2, False, False, 1.0, 1.0, 0),  # the first token: nothing cached
    (96, 6, 2, True, True, 1.0, 1.0, 31),
]


# key splits: 0 = a block per query head; the split kernel with 1 split (a block per KV head's
# query heads) and 8 (the last block of a head group merges them; FUSELM_ATTN_SPLIT)
ATTEND_SPLITS = [0, 1, 8]


@cuda
@pytest.mark.parametrize("splits", ATTEND_SPLITS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("d,hq,hk,norms,inter,frac,ascale,pos", ROPE_CASES)
def test_rope_attend_kernel(dtype: mx.Dtype, d: int, hq: int, hk: int, norms: bool,
                            inter: bool, frac: float, ascale: float, pos: int,
                            splits: int) -> None:
    """splits: 0 = a block per query head, N = the split kernel (FUSELM_ATTN_SPLIT; position
    0 leaves 7 of 8 splits empty)."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    rng = np.random.default_rng(d + hq + pos)
    rd = int(d * frac)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rd, 2) / rd)).astype(np.float32)
    cap = (pos // 256 + 1) * 256
    q, qf = rounded(rng.normal(size=(1, 1, hq * d)), dtype)
    k, kf = rounded(rng.normal(size=(1, 1, hk * d)), dtype)
    v, vf = rounded(rng.normal(size=(1, 1, hk * d)), dtype)
    cache_k = rng.normal(size=(1, hk, cap, d))
    cache_v = rng.normal(size=(1, hk, cap, d))
    cache_k[:, :, pos:] = 50.0  # rows past the position must not be attended
    cache_v[:, :, pos:] = 1e4
    kc, kcf = rounded(cache_k, dtype)
    vc, vcf = rounded(cache_v, dtype)
    qn = kn = None
    qnf = knf = None
    if norms:
        qn, qnf = rounded(rng.uniform(0.5, 1.5, d), dtype)
        kn, knf = rounded(rng.uniform(0.5, 1.5, d), dtype)
    scale = 1.0 / np.sqrt(d)
    attrs = dict(head_dim=d, rotary_dim=rd, inv_freq=inv_freq.tolist(), attention_scale=ascale,
                 interleaved=int(inter), norm_eps=1e-6)
    qr, kr = fused_rope_reference(qf, kf, np.array([[pos]]), qnf, knf, **attrs)
    k_row = kr.reshape(hk, d)
    keys = np.concatenate([kcf[0, :, :pos], k_row[:, None]], axis=1)
    values = np.concatenate([vcf[0, :, :pos], vf.reshape(hk, 1, d)], axis=1)
    y_ref = _attention_reference(qr.reshape(hq, d), keys, values, scale)

    prm = (1e-6, scale, ascale)
    fn = mx.compile(lambda *a: kernels_cuda.rope_attend(
        *a, hq=hq, hk=hk, rotary_dim=rd, interleaved=inter, splits=splits))
    y, k_cache, v_cache = fn(q, k, v, qn, kn, mx.array(inv_freq), prm,
                             mx.array([pos], mx.int32), kc, vc)
    tol = TOL[dtype]
    assert rel(np.array(y.astype(mx.float32)).reshape(-1), y_ref) <= tol * 2
    # the new row was written into the cache in place, and nothing else was
    k_after = np.array(k_cache.astype(mx.float32))
    v_after = np.array(v_cache.astype(mx.float32))
    assert rel(k_after[0, :, pos], k_row) <= tol
    assert np.array_equal(v_after[0, :, pos].reshape(-1), vf.reshape(-1))
    keep = np.ones(cap, bool)
    keep[pos] = False
    assert np.array_equal(k_after[:, :, keep], kcf[:, :, keep])
    assert np.array_equal(v_after[:, :, keep], vcf[:, :, keep])


@cuda
@pytest.mark.parametrize("rows", [1, 3])
def test_split_partials_in_scratch_equal_partials_as_outputs(monkeypatch: pytest.MonkeyPatch,
                                                             rows: int) -> None:
    """The split kernel keeps its partials in the module's scratch (one output array instead
    of four: host time on MLX-CUDA); a launch whose partials would not fit takes them as
    outputs. Both forms give bit-equal outputs and cache writes, over several calls in a
    row (the scratch is reused)."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    dtype, d, hq, hk, cap = mx.float16, 64, 32, 8, 512
    rng = np.random.default_rng(rows)
    inv_freq = mx.array((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    prm = (1e-6, 1 / np.sqrt(d), 1.0)
    q, _ = rounded(rng.normal(size=(rows, 1, hq * d)), dtype)
    k, _ = rounded(rng.normal(size=(rows, 1, hk * d)), dtype)
    v, _ = rounded(rng.normal(size=(rows, 1, hk * d)), dtype)
    cache = rng.normal(size=(2, rows, hk, cap, d))
    results = {}
    for scratch in (kernels_cuda.SPLIT_SCRATCH, 0):
        monkeypatch.setattr(kernels_cuda, "SPLIT_SCRATCH", scratch)
        (kc, _), (vc, _) = rounded(cache[0], dtype), rounded(cache[1], dtype)
        ys = []
        for pos in (100, 101, 300):
            y, kc, vc = kernels_cuda.rope_attend(
                q, k, v, None, None, inv_freq, prm, mx.array([pos] * rows, mx.int32), kc, vc,
                hq=hq, hk=hk, rotary_dim=d, interleaved=False, splits=8)
            mx.eval(y, kc, vc)
            ys.append(np.array(y.astype(mx.float32)))
        results[scratch] = (np.stack(ys), np.array(kc.astype(mx.float32)),
                            np.array(vc.astype(mx.float32)))
    (a, b) = results.values()
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert np.isfinite(a[0]).all()


def test_add_norm_fits_only_what_its_scratch_holds() -> None:
    """Everywhere: the add+norm GEMV keeps each block's share of the sums of squares in its
    module's scratch, so it takes only rows x blocks that fit there (else the caller runs
    the separate add+norm)."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4

    packed = mx.zeros((4096, 128), mx.uint32)
    x = mx.zeros((16, 1, 1024), mx.float16)
    r, w = mx.zeros((16, 1, 4096), mx.float16), mx.zeros((4096,), mx.float16)
    assert kernels_q4.add_norm_fits(x, packed, r, w)
    wide = mx.zeros((65536, 128), mx.uint32)  # 8,192 blocks x 16 rows: past the scratch
    assert not kernels_q4.add_norm_fits(x, wide, mx.zeros((16, 1, 65536), mx.float16),
                                        mx.zeros((65536,), mx.float16))
    assert kernels_q4.add_norm_fits(x[:1], wide, mx.zeros((1, 1, 65536), mx.float16),
                                    mx.zeros((65536,), mx.float16))


# ---- MLX-CUDA: the whole program, kernels on against kernels off -------------------------------

@cuda
@pytest.mark.parametrize("split", ["0", "auto"])
def test_program_with_kernels_matches_plain_path(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 split: str) -> None:
    """A Qwen3 model with head_dim 64 != hidden/heads and GQA 2:1, float32: 32 greedy tokens
    identical with the kernels on and off (and the decode step really without MLX's SDPA
    fallback: no Softmax/Matmul primitives in its graph); the attention a block per query
    head and split (FUSELM_ATTN_SPLIT)."""
    from fuselm.converter.models.builtin import build_model
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    hf = build_model(tmp_path / "hf", "qwen3", seed=5, hidden_size=96, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2)
    out = convert(hf, tmp_path / "out")
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 384, 300)]
    tokens, graphs = {}, {}
    for mode in ("off", "on"):
        engine = make_engine(out, "mlx", RuntimeConfig(kernels=mode, attn_split=split))
        assert engine.fast.program.kernels is (mode == "on")
        assert engine.fast.program.split_attention is (mode == "on" and split == "auto")
        tokens[mode] = generate(engine, prompt, max_new_tokens=32, prefill_chunk=128).tokens
        dot = tmp_path / f"{mode}.dot"
        y = mx.array(tokens[mode][-1], mx.int32)
        mx.export_to_dot(str(dot), engine.decode_step(y))
        graphs[mode] = collections.Counter(
            re.findall(r'\[label\s*=\s*"?([A-Za-z]+)', dot.read_text()))
    assert tokens["on"] == tokens["off"]
    assert graphs["on"]["Softmax"] == 0 and graphs["off"]["Softmax"] > 0


@cuda
@pytest.mark.parametrize("splits", ATTEND_SPLITS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rope_attend_kernel_batch_rows_equal_single_rows(dtype: mx.Dtype, splits: int) -> None:
    """Batch rows, each at its own position, give exactly what each row gives alone."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    rng = np.random.default_rng(7)
    d, hq, hk, cap, positions = 128, 8, 2, 512, [3, 300, 0, 47]
    b = len(positions)
    inv_freq = mx.array((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    q = rounded(rng.normal(size=(b, 1, hq * d)), dtype)[0]
    k = rounded(rng.normal(size=(b, 1, hk * d)), dtype)[0]
    v = rounded(rng.normal(size=(b, 1, hk * d)), dtype)[0]
    kc = rounded(rng.normal(size=(b, hk, cap, d)), dtype)[0]
    vc = rounded(rng.normal(size=(b, hk, cap, d)), dtype)[0]
    norm = rounded(rng.uniform(0.5, 1.5, d), dtype)[0]
    prm = (1e-6, 1.0 / np.sqrt(d), 1.0)

    def run(rows: slice, pos: list[int]) -> tuple[mx.array, ...]:
        return kernels_cuda.rope_attend(q[rows], k[rows], v[rows], norm, norm, inv_freq, prm,
                                        mx.array(pos, mx.int32), kc[rows], vc[rows], hq=hq,
                                        hk=hk, rotary_dim=d, interleaved=False,
                                        splits=splits)

    together = run(slice(0, b), positions)[0]
    for i, p in enumerate(positions):
        alone = run(slice(i, i + 1), [p])[0]
        assert np.array_equal(np.array(together[i:i + 1].astype(mx.float32)),
                              np.array(alone.astype(mx.float32)))


@cuda
@pytest.mark.parametrize("splits", ATTEND_SPLITS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_rope_attend_through_a_block_table_equals_contiguous_rows(dtype: mx.Dtype,
                                                                  splits: int) -> None:
    """The caches as block pools (kv_cache.BlockCache) read and written through a block table
    (blocks of a row scattered over the pool, out of order) give exactly what contiguous
    [rows, heads, capacity, D] caches give: the output and the new K/V row, each at its
    position in its block."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
    from fuselm.runtime_metal.kv_cache import BLOCK, read_blocks

    rng = np.random.default_rng(13)
    d, hq, hk, cap, positions = 128, 8, 2, 512, [3, 300, 0, 130]
    b, w = len(positions), cap // BLOCK
    inv_freq = mx.array((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    q = rounded(rng.normal(size=(b, 1, hq * d)), dtype)[0]
    k = rounded(rng.normal(size=(b, 1, hk * d)), dtype)[0]
    v = rounded(rng.normal(size=(b, 1, hk * d)), dtype)[0]
    norm = rounded(rng.uniform(0.5, 1.5, d), dtype)[0]
    caches = rounded(rng.normal(size=(2, b, hk, cap, d)), dtype)[1]
    prm = (1e-6, 1.0 / np.sqrt(d), 1.0)
    table = rng.permutation(b * w + 3)[:b * w].reshape(b, w).astype(np.int32)
    pools = []
    for c in caches:  # row r's block j: positions j*BLOCK.. of row r, at table[r, j]
        pool = np.zeros((b * w + 3, hk, BLOCK, d), np.float32)
        blocks = c.reshape(b, hk, w, BLOCK, d).transpose(0, 2, 1, 3, 4)
        pool[table.reshape(-1)] = blocks.reshape(-1, hk, BLOCK, d)
        pools.append(mx.array(pool).astype(dtype))
    bt = mx.array(table)
    y_p, kp, vp = kernels_cuda.rope_attend(
        q, k, v, norm, norm, inv_freq, prm, mx.array(positions, mx.int32), pools[0], pools[1],
        hq=hq, hk=hk, rotary_dim=d, interleaved=False, splits=splits, table=bt)
    kc, vc = (mx.array(c).astype(dtype) for c in caches)
    y_c, kc, vc = kernels_cuda.rope_attend(
        q, k, v, norm, norm, inv_freq, prm, mx.array(positions, mx.int32), kc, vc, hq=hq,
        hk=hk, rotary_dim=d, interleaved=False, splits=splits)
    assert np.array_equal(np.array(y_p.astype(mx.float32)), np.array(y_c.astype(mx.float32)))
    for pool, contiguous in ((kp, kc), (vp, vc)):
        assert np.array_equal(np.array(read_blocks(pool, bt).astype(mx.float32)),
                              np.array(contiguous.astype(mx.float32)))


@cuda
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("splits", [0, 3])
def test_rope_attend_reads_a_fused_qkv_row(splits: int, norms: bool) -> None:
    """q, k and v read from the fused projection they are slices of (qkv=: the launch's one
    input for the three; batch rows at their own positions) give exactly what the three
    separate arrays give, caches included; without q/k-norm (Llama) and with it (Qwen3)."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    rng = np.random.default_rng(11)
    dtype, d, hq, hk, cap, positions = mx.float16, 64, 8, 2, 256, [5, 200]
    b = len(positions)
    qkv = rounded(rng.normal(size=(b, 1, (hq + 2 * hk) * d)), dtype)[0]
    q, k, v = qkv[..., :hq * d], qkv[..., hq * d:(hq + hk) * d], qkv[..., (hq + hk) * d:]
    qn = rounded(rng.uniform(0.5, 1.5, d), dtype)[0] if norms else None
    kn = rounded(rng.uniform(0.5, 1.5, d), dtype)[0] if norms else None
    inv_freq = mx.array((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    prm = (1e-6, 1.0 / np.sqrt(d), 1.0)
    caches = rounded(rng.normal(size=(2, b, hk, cap, d)), dtype)[1]
    got = []
    for joined in (None, qkv):  # fresh cache buffers each time: the kernel writes in place
        kc, vc = (mx.array(c).astype(dtype) for c in caches)
        y, kc, vc = kernels_cuda.rope_attend(
            q, k, v, qn, kn, inv_freq, prm, mx.array(positions, mx.int32), kc, vc, hq=hq,
            hk=hk, rotary_dim=d, interleaved=False, splits=splits, qkv=joined)
        got.append([np.array(a.astype(mx.float32)) for a in (y, kc, vc)])
    for a, b_ in zip(*got, strict=True):
        assert np.array_equal(a, b_)


@cuda
def test_batch_decoder_with_kernels_matches_generate(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched program on MLX-CUDA (the rope+attention kernel over b rows): greedy tokens
    of three sequences of different lengths, joined at different steps, equal generate's."""
    from fuselm.converter.models.builtin import build_model
    from fuselm.runtime_metal.engine import make_engine

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    hf = build_model(tmp_path / "hf", "qwen3", seed=5, hidden_size=96, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2)
    engine = make_engine(convert(hf, tmp_path / "out"), "mlx", RuntimeConfig(kernels="on"))
    joined_rows_equal_generate(engine)


# ---- MLX-CUDA: the Q4 GEMV kernel (kernels_q4.py) ----------------------------------------------

def _q4_weight(rng: np.random.Generator, k: int, n: int, group: int,  # noqa: ANN202
               bits: int = 4):
    """A QWeight as the planner makes it (blocked DequantizeLinear along K of a [K, N] weight,
    uint4 codes, or uint8 ones with bits=8), stored as M [N, K] (transposed)."""
    import ml_dtypes

    from fuselm.runtime_metal.mlx_engine.qweight import from_dequantize_linear

    kind = ml_dtypes.uint4 if bits == 4 else np.uint8
    codes = rng.integers(0, 2 ** bits, (k, n)).astype(kind)
    scales = rng.uniform(0.01, 0.05, (k // group, n)).astype(np.float32) / 2 ** (bits - 4)
    zp = rng.integers(0, 2 ** bits, (k // group, n)).astype(kind)
    w = from_dequantize_linear(codes, scales, zp, axis=0, block_size=group)
    assert w.transposed and w.bits == bits and w.packed.shape == (n, k * bits // 32)
    return w, codes.astype(np.float64)


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_q4_take_rows_kernel(dtype: mx.Dtype, group: int) -> None:
    """A quantized embedding lookup in one launch against MLX's gathers + dequantize: rows
    (negative indices from the end, as ONNX Gather) within a unit in the last place of the
    dtype, exact in float32; uint32 indices give the int32 ones' rows."""
    from fuselm.runtime_metal.cuda_kernels import embedding as kernels_embedding
    from fuselm.runtime_metal.mlx_engine import qweight

    rng = np.random.default_rng(group)
    w, _ = _q4_weight(rng, 256, 1000, group)  # M [1000, 256]: a 1000-row table of width 256
    table = qweight.QWeight(w.packed, w.scales.astype(dtype), w.biases.astype(dtype), group,
                            False, dtype, {})
    ids = mx.array([[3, 999, -1, 0, 517, -1000]], mx.int32)
    plain = table.take_rows(ids)
    with qweight.gemv_kernel():
        fast = table.take_rows(ids)
    a, b = np.array(fast.astype(mx.float32)), np.array(plain.astype(mx.float32))
    assert fast.shape == plain.shape == (1, 6, 256) and fast.dtype == dtype
    assert np.array_equal(a[0, 2], a[0, 1]) and np.array_equal(a[0, 5], a[0, 3])
    if dtype == mx.float32:
        assert rel(a, b) <= 1e-6
    else:
        assert rel(a, b) <= TOL[dtype]
    # the argmax's uint32 token, as a decode step hands it over: the same rows exactly
    ids_u = mx.array([[3, 999, 0, 517]], mx.uint32)
    assert kernels_embedding.take_fits(ids_u, table.packed, table.scales, group, 4)
    with qweight.gemv_kernel():
        fast_u = np.array(table.take_rows(ids_u).astype(mx.float32))
    assert np.array_equal(fast_u[0], a[0, [0, 1, 3, 4]])


GEMV_CASES = [
    # rows, K, N, group, gated activation
    (1, 1024, 2048, 32, None),  # Qwen3-0.6B's q/k/v rows, one sequence
    (16, 1024, 6144, 64, "silu"),  # a 16-row batch through a gate/up weight
    (3, 96, 64, 32, "gelu_tanh"),  # K below one warp's 256 codes
    (8, 3072, 1024, 128, None),  # down projection
    (1, 14336, 256, 32, None),  # Llama-3.1-8B's down projection width
]


@cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows,k,n,group,act", GEMV_CASES)
def test_q4_gemv_kernel(dtype: mx.Dtype, rows: int, k: int, n: int, group: int,
                        act: str | None, bits: int) -> None:
    """Against the dequantized weight in float64 (the weight's affine terms as the kernel
    reads them, in the activation dtype); each row alone gives exactly its row of the batch.
    4-bit and 8-bit weights (BITS = 8: 4 codes a word)."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.mlx_engine import qweight

    rng = np.random.default_rng(rows * k + n)
    w, codes = _q4_weight(rng, k, n, group, bits)
    x, xf = rounded(rng.normal(size=(rows, 1, k)), dtype)
    s, b = w.affine(dtype)
    sf = np.array(s.astype(mx.float32)).astype(np.float64)  # [N, K/G]
    bf = np.array(b.astype(mx.float32)).astype(np.float64)
    dense = codes * np.repeat(sf.T, group, axis=0) + np.repeat(bf.T, group, axis=0)  # [K, N]
    y_ref = xf.reshape(rows, k).astype(np.float64) @ dense
    assert kernels_q4.fits(x, w.packed, s, group, bits, True, act)
    with qweight.gemv_kernel():
        y = w.gated_matmul(x, act) if act else w.matmul(x)
    assert y is not None
    tol = TOL[dtype]
    if act:
        half = n // 2
        g = np.array(mx.array(y_ref[:, :half].astype(np.float32)).astype(dtype)
                     .astype(mx.float32)).astype(np.float64)
        u = np.array(mx.array(y_ref[:, half:].astype(np.float32)).astype(dtype)
                     .astype(mx.float32)).astype(np.float64)
        if act == "silu":
            a = g / (1 + np.exp(-g))
        else:
            a = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        y_ref, tol = a * u, tol * 3
    got = np.array(y.astype(mx.float32)).reshape(rows, -1)
    assert got.shape == y_ref.shape
    assert rel(got, y_ref) <= tol
    mma = kernels_q4.use_mma(x, w.packed, act)  # the batch's kernel (FUSELM_GEMV_MMA)
    for i in range(rows):
        alone = kernels_q4.q4_gemv(x[i:i + 1], w.packed, s, b, group, act, mma=mma)
        assert np.array_equal(np.array(alone.astype(mx.float32)).reshape(-1), got[i])
    if not act:  # the LM head's form: float32 out, the values of the T result widened
        with qweight.gemv_kernel(), qweight.float32_result():
            wide = w.matmul(x)
        assert wide.dtype == mx.float32
        assert np.array_equal(np.array(wide).reshape(rows, -1), got)


@cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows,k,n,act", [(1, 8192, 512, None), (3, 4096, 256, "silu"),
                                          (1, 3072, 1024, None), (2, 14336, 256, None)])
def test_q4_gemv_loads_in_flight_do_not_change_results(dtype: mx.Dtype, rows: int, k: int,
                                                       n: int, act: str | None) -> None:
    """How many of a lane's weight loads the GEMV keeps in flight (kernels.Q4_UNROLL: two at a
    time, or the whole row) changes no bit of the plain, gated, float32-out and add+norm
    forms: the sums run in the same order."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4

    rng = np.random.default_rng(k + n)
    w, _ = _q4_weight(rng, k, n, 32)
    x, _ = rounded(rng.normal(size=(rows, 1, k)), dtype)
    s, b = w.affine(dtype)
    out_n = n // 2 if act else n
    r, _ = rounded(rng.normal(size=(rows, 1, out_n)) * 3, dtype)
    scale, _ = rounded(rng.uniform(0.5, 1.5, out_n), dtype)
    eps = 1e-6

    def forms(unroll: int) -> list[np.ndarray]:  # the one-column-a-warp kernel's (mma off)
        got = [kernels_q4.q4_gemv(x, w.packed, s, b, 32, act, unroll=unroll, mma=False)]
        if not act:
            got.append(kernels_q4.q4_gemv(x, w.packed, s, b, 32, None, mx.float32, unroll,
                                          mma=False))
            got.append(kernels_q4.q4_gemv_add_norm(x, w.packed, s, b, 32, r, scale, eps,
                                                   unroll, mma=False))  # hy: h and y
        return [np.array(a.astype(mx.float32)) for a in got]

    two, whole = forms(2), forms(16)
    assert len(two) == len(whole) == (1 if act else 3)
    for a, c in zip(two, whole, strict=True):
        assert np.array_equal(a, c)


def test_gemv_mma_selection(launches: list) -> None:
    """Everywhere (no launch): FUSELM_GEMV_MMA picks the tensor-core form from its row count on
    (auto: never, until it is measured on a GPU), for float16 / bfloat16 activations and
    outputs of whole 8-column tiles; one row,
    float32 activations, 0 (off) and an odd output width keep the one-column-a-warp kernel.
    The tile (NJ, NWK) follows the weight's shape, never the rows."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.mlx_engine import qweight

    w, _ = _q4_weight(np.random.default_rng(0), 256, 64, 32)

    def names(x: mx.array) -> list[str]:
        launches.clear()
        with qweight.gemv_kernel():
            w.matmul(x)
            w.gated_matmul(x, "silu")
            w.matmul_add_norm(x, mx.zeros((*x.shape[:-1], 64), x.dtype),
                              mx.ones((64,), x.dtype), 1e-6)
        return [str(r["name"]) for r in launches]

    mma = ["fuselm_q4_gemv_mma", "fuselm_q4_gemv_mma", "fuselm_q4_gemv_mma_addnorm"]
    one = ["fuselm_q4_gemv", "fuselm_q4_gemv", "fuselm_q4_gemv_addnorm"]
    try:
        kernels.configure(resolve({}))
        assert kernels.gemv_mma_rows() == kernels.GEMV_MMA_ROWS == 0
        assert names(mx.zeros((16, 1, 256), mx.float16)) == one
        kernels.configure(resolve({"FUSELM_GEMV_MMA": "2"}))
        for dtype in (mx.float16, mx.bfloat16):
            assert names(mx.zeros((1, 1, 256), dtype)) == one
            assert names(mx.zeros((2, 1, 256), dtype)) == mma
            assert names(mx.zeros((16, 1, 256), dtype)) == mma
            assert [r["template"]["NWK"] for r in launches] == [2, 2, 2]  # K: 2 x 128 codes
        assert names(mx.zeros((16, 1, 256), mx.float32)) == one
        kernels.configure(resolve({"FUSELM_GEMV_MMA": "0"}))
        assert names(mx.zeros((16, 1, 256), mx.float16)) == one
        kernels.configure(resolve({"FUSELM_GEMV_MMA": "1"}))
        assert names(mx.zeros((1, 1, 256), mx.float16)) == mma
        kernels.configure(resolve({"FUSELM_GEMV_MMA": "5"}))
        assert names(mx.zeros((4, 1, 256), mx.float16)) == one
        assert names(mx.zeros((5, 1, 256), mx.float16)) == mma
    finally:
        kernels.configure(resolve())
    odd = mx.zeros((60, 32), mx.uint32)
    assert not kernels_q4.mma_fits(mx.zeros((5, 1, 256), mx.float16), odd)
    with pytest.raises(ValueError, match="tensor-core"):
        kernels_q4.q4_gemv(mx.zeros((5, 1, 256), mx.float16), odd, mx.zeros((60, 8)),
                           mx.zeros((60, 8)), 32, mma=True)
    # Qwen3-0.6B's GEMVs: 16 / 32-column tiles while >= 128 blocks remain, a warp a K step
    # (128 codes) up to what shared memory holds
    assert kernels_q4.mma_tiles(4096, 1024, 4) == (4, 8)  # q/k/v
    assert kernels_q4.mma_tiles(3072, 1024, 4, gated=True) == (2, 8)  # gate/up
    assert kernels_q4.mma_tiles(1024, 2048, 4) == (1, 16)  # o_proj
    assert kernels_q4.mma_tiles(1024, 3072, 4) == (1, 24)  # down
    assert kernels_q4.mma_tiles(151936, 1024, 4) == (4, 8)  # LM head
    assert kernels_q4.mma_tiles(4096, 14336, 4) == (4, 22)  # an 8B down: shared memory's bound
    assert kernels_q4.mma_tiles(64, 96, 4) == (1, 1)


MMA_CASES = [
    # K, N, group, form, bits: Qwen3-0.6B's decode GEMVs, 8-bit codes, K below one step
    (1024, 4096, 32, "plain", 4),  # q/k/v
    (1024, 6144, 32, "silu", 4),  # gate/up, the gated epilogue
    (2048, 1024, 64, "addnorm", 4),  # o_proj with the add+RMSNorm epilogue
    (3072, 1024, 32, "addnorm", 4),  # down
    (1024, 8192, 32, "logits", 4),  # an LM head: float32 logits, 32-column tiles
    (3072, 1024, 64, "plain", 8),
    (96, 64, 32, "gelu_tanh", 4),
]


@cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("k,n,group,form,bits", MMA_CASES)
def test_q4_gemv_mma_kernel(dtype: mx.Dtype, k: int, n: int, group: int, form: str,
                            bits: int) -> None:
    """The tensor-core form at 1, 2, 5, 8 and 16 rows against MLX's reference: the weight as
    mx.dequantize gives it (in the activation dtype) times x, in float64. Each row's result
    is the same bits in every batch (the first rows of the 16 alone, 1 .. 8 of them). The
    add+norm form: h bit-equal to its plain form's result plus the residual (the separate
    add+RMSNorm kernel), y within the dtype's tolerance, a second call bit-equal."""
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

    rng = np.random.default_rng(k + n + bits)
    w, _ = _q4_weight(rng, k, n, group, bits)
    s, b = w.affine(dtype)
    dense = np.array(mx.dequantize(w.packed, s, b, group_size=group, bits=bits)
                     .astype(mx.float32)).astype(np.float64)  # M [N, K]
    x16, xf = rounded(rng.normal(size=(16, 1, k)), dtype)
    y16 = xf.reshape(16, k).astype(np.float64) @ dense.T
    act = form if form in kernels_q4.ACTIVATIONS else None
    out_n = n // 2 if act else n
    r16, _ = rounded(rng.normal(size=(16, 1, out_n)) * 3, dtype)
    scale, _ = rounded(rng.uniform(0.5, 1.5, out_n), dtype)
    eps = 1e-6

    def as_dtype(a: np.ndarray) -> np.ndarray:  # float64 values rounded to dtype
        return np.array(mx.array(a.astype(np.float32)).astype(dtype)
                        .astype(mx.float32)).astype(np.float64)

    def f32(a: mx.array) -> np.ndarray:
        return np.array(a.astype(mx.float32))

    got: dict[int, list[np.ndarray]] = {}
    for rows in (16, 1, 2, 5, 8):
        x, r = x16[:rows], r16[:rows]
        assert kernels_q4.fits(x, w.packed, s, group, bits, True, act)
        y_ref, tol = y16[:rows], TOL[dtype]
        if form == "addnorm":
            plain = kernels_q4.q4_gemv(x, w.packed, s, b, group, mma=True)
            h_sep, y_sep = kernels_cuda.add_rms_norm(plain, r, scale, eps)
            hys = [kernels_q4.q4_gemv_add_norm(x, w.packed, s, b, group, r, scale, eps,
                                               mma=True) for _ in range(2)]
            assert hys[0].shape == (2, rows, 1, n)
            h, y = f32(hys[0])
            assert np.array_equal(h, f32(h_sep))
            assert rel(y, f32(y_sep)) <= tol
            assert np.array_equal(f32(hys[1]), f32(hys[0]))
            assert rel(f32(plain).reshape(rows, n), y_ref) <= tol
            got[rows] = [h, y]
            continue
        out = kernels_q4.q4_gemv(x, w.packed, s, b, group, act,
                                 mx.float32 if form == "logits" else None, mma=True)
        assert out.shape == (rows, 1, out_n)
        assert out.dtype == (mx.float32 if form == "logits" else dtype)
        if act:
            g, u = as_dtype(y_ref[:, :out_n]), as_dtype(y_ref[:, out_n:])
            if act == "silu":
                a = g / (1 + np.exp(-g))
            else:
                a = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            y_ref, tol = a * u, tol * 3
        res = f32(out).reshape(rows, out_n)
        assert rel(res, y_ref) <= tol
        if form == "logits":  # the values of the dtype's result, widened
            plain = kernels_q4.q4_gemv(x, w.packed, s, b, group, mma=True)
            assert np.array_equal(f32(plain).reshape(rows, n), res)
        got[rows] = [res]
    for rows in (1, 2, 5, 8):  # batch invariance: a row's bits do not depend on its batch
        for a, full in zip(got[rows], got[16], strict=True):
            assert np.array_equal(a, full[:rows])

@cuda
def test_batch_decoder_on_tensor_core_gemvs_matches_generate(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A float16 Q4 Qwen3 decoding on the tensor-core GEMVs at every row count
    (FUSELM_GEMV_MMA=1, the one-row step too): the batched program's greedy tokens for three
    sequences joining at different steps equal generate's, one sequence at a time (the GEMVs
    compute each row as they would alone), and the decode steps did run that form."""
    from fuselm.converter.models.builtin import build_model
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.engine import make_engine

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    ran: collections.Counter[bool] = collections.Counter()
    real = kernels_q4.use_mma

    def counted(*a: object, **kw: object) -> bool:
        got = real(*a, **kw)  # type: ignore[arg-type]
        ran[got] += 1
        return got
    monkeypatch.setattr(kernels_q4, "use_mma", counted)
    hf = build_model(tmp_path / "hf", "qwen3", seed=5, hidden_size=128, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    out = convert(hf, tmp_path / "q4", dtype="float16", quant="q4", quant_embeddings=True)
    try:
        engine = make_engine(out, "mlx", RuntimeConfig(kernels="on", gemv_mma=1))
        assert kernels.gemv_mma_rows() == 1
        joined_rows_equal_generate(engine, new_tokens=12)
    finally:
        kernels.configure(resolve())
    assert ran[True] > 0 and ran[False] == 0

def _q4_qwen3(tmp_path: Path, seed: int) -> Path:
    """A Q4 Qwen3 (GQA 2:1, head_dim 64, embeddings and LM head quantized) from float32."""
    from fuselm.converter.models.builtin import build_model
    from tests.runtime.conftest import quantized_copy

    hf = build_model(tmp_path / "hf", "qwen3", seed=seed, hidden_size=128, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    return quantized_copy(convert(hf, tmp_path / "f32"), tmp_path / "q4", lm_head=True,
                          embeddings=True)


@cuda
def test_q4_program_with_kernels_matches_plain_path(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4 Qwen3 (GQA 2:1, head_dim 64, embeddings and LM head quantized), float32: the
    decode step's logits with every kernel on (Q4 GEMV, gated epilogue, in-place K/V) against
    MLX's built-ins, step after step from the same prompt, and the same greedy tokens."""
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    out = _q4_qwen3(tmp_path, seed=6)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 384, 40)]
    logits, tokens = {}, {}
    for mode in ("off", "on"):
        engine = make_engine(out, "mlx", RuntimeConfig(kernels=mode))
        assert engine.fast.program.kernels is (mode == "on")
        tokens[mode] = generate(engine, prompt, max_new_tokens=16).tokens
        engine.reset()
        engine.reserve(len(prompt) + 8)
        engine.forward(np.asarray([prompt]))
        rows = []
        for t in tokens[mode][:8]:
            rows.append(np.array(engine.decode_step(mx.array(t, mx.int32))))
        logits[mode] = np.stack(rows)
    assert rel(logits["on"], logits["off"]) <= 1e-4
    assert tokens["on"] == tokens["off"]


@cuda
def test_q4_decode_step_launches_no_cast(tmp_path: Path) -> None:
    """A float16 Q4 decode step with the kernels: no AsType node in its graph (the argmax's
    uint32 token goes into the embedding kernel as it is, the LM head's GEMV writes float32
    logits), and a uint32 token gives exactly the logits of the same token as int32."""
    from fuselm.converter.models.builtin import build_model
    from fuselm.runtime_metal.engine import make_engine

    hf = build_model(tmp_path / "hf", "qwen3", seed=3, hidden_size=128, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    out = convert(hf, tmp_path / "q4", dtype="float16", quant="q4", quant_embeddings=True)
    engine = make_engine(out, "mlx", RuntimeConfig(kernels="on"))
    fast = engine.fast
    assert fast is not None and fast.program.kernels
    engine.reserve(24)
    engine.forward(np.asarray([[5, 17, 33, 2, 90]]))
    kv = [a for c in fast.caches for a in c.buffers()]
    offset = mx.array(fast.caches[0].offset, mx.int32)
    outs = {dt: fast.program(mx.array(7, dt), offset, *kv) for dt in (mx.uint32, mx.int32)}
    logits = outs[mx.uint32][0]
    assert logits.dtype == mx.float32
    dot = tmp_path / "step.dot"
    mx.export_to_dot(str(dot), *outs[mx.uint32])
    labels = re.findall(r'label\s*=\s*"([^"]*)"', dot.read_text())
    assert any(label.startswith("CustomKernel") for label in labels)
    assert not [label for label in labels if label.startswith("AsType")]
    # the add+norm GEMVs' h and y are read out of their one output: no views evaluated
    assert not [label for label in labels if label.startswith(("Slice", "Gather"))]
    assert np.array_equal(np.array(logits), np.array(outs[mx.int32][0]))
    assert np.isfinite(np.array(logits)).all()


# ---- the add+RMSNorm in the epilogue of the Q4 GEMV making its row (q4_gemv_add_norm) --------

def test_fold_into_producers_finds_each_layers_projections(q4_artifact: Path) -> None:
    """Everywhere (plain Python): each residual add+RMSNorm gets the Q4 MatMul making its
    added row as the op computing it in its epilogue: a layer's o_proj and down projection
    (the last down feeds the final norm), whose only reader is that Add; 2 per layer."""
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.mlx_engine import program_ops

    program = make_engine(q4_artifact, "mlx").fast.program
    program_ops.fold_into_producers(program.ops)
    pairs = [o for o in program.ops if o.norm_producer is not None]
    assert collections.Counter(o.norm_producer.step.op_type for o in pairs) == {
        "MatMul": 2 * program.num_layers}
    at = {id(o): i for i, o in enumerate(program.ops)}
    for o in pairs:
        made = o.norm_producer.step.outputs[0]
        assert o.args[o.producer_arg] == ("env", made)
        assert at[id(o.norm_producer)] < at[id(o)]
        assert sum(("env", made) in p.args for p in program.ops) == 1  # the Add alone reads it


@cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows,k,n", [(1, 2048, 1024), (4, 3072, 1024), (1, 14336, 4096),
                                      (3, 96, 64)])
def test_q4_gemv_add_norm_epilogue(dtype: mx.Dtype, rows: int, k: int, n: int,
                                   bits: int) -> None:
    """The GEMV with the residual add + RMSNorm in its epilogue against the plain GEMV followed
    by the add+RMSNorm kernel: the sum h bit-equal; y within the dtype's tolerance (the sum of
    squares is formed in another order); a second call bit-equal to the first (the last-block
    ticket is back to zero, and the order of sums does not depend on which block came last)."""
    from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda
    from fuselm.runtime_metal.mlx_engine import qweight

    rng = np.random.default_rng(rows + k + n)
    w, _ = _q4_weight(rng, k, n, 32, bits)
    x, _ = rounded(rng.normal(size=(rows, 1, k)), dtype)
    r, _ = rounded(rng.normal(size=(rows, 1, n)) * 3, dtype)
    scale, _ = rounded(rng.uniform(0.5, 1.5, n), dtype)
    eps = 1e-6
    with qweight.gemv_kernel():
        plain = w.matmul(x)
        fused = [w.matmul_add_norm(x, r, scale, eps) for _ in range(2)]
    h_ref, y_ref = kernels_cuda.add_rms_norm(plain, r, scale, eps)
    hr, yr = np.array(h_ref.astype(mx.float32)), np.array(y_ref.astype(mx.float32))
    ys = []
    for got in fused:
        assert got is not None
        h, y = (np.array(a.astype(mx.float32)) for a in got)
        assert np.array_equal(h, hr)
        assert rel(y, yr) <= TOL[dtype]
        ys.append(y)
    assert np.array_equal(ys[0], ys[1])


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows,k,n,n2", [(1, 2048, 1024, 3072), (4, 3072, 1024, 2048),
                                         (3, 96, 64, 96)])
def test_q4_gemvs_read_add_norm_rows_out_of_its_output(dtype: mx.Dtype, rows: int, k: int,
                                                       n: int, n2: int) -> None:
    """h and y read by the next GEMVs out of the add+norm's one output hy (at offsets XO /
    RO: qweight._packed) against the same GEMVs over copies of h and y (fresh arrays read
    at 0): the plain, gated and float32-out GEMV over y and the next add+norm with h as its
    residual, all bit-equal; h and y themselves (the views) equal the rows of hy."""
    from fuselm.runtime_metal.mlx_engine import qweight

    rng = np.random.default_rng(rows + k + n)
    w, _ = _q4_weight(rng, k, n, 32)
    w2, _ = _q4_weight(rng, n, 2 * n2, 32)
    x, _ = rounded(rng.normal(size=(rows, 1, k)), dtype)
    r, _ = rounded(rng.normal(size=(rows, 1, n)) * 3, dtype)
    scale, _ = rounded(rng.uniform(0.5, 1.5, n), dtype)
    eps = 1e-6

    def copy(a: mx.array) -> mx.array:  # a fresh array of a's values: no view of hy
        return mx.array(np.array(a.astype(mx.float32))).astype(a.dtype)

    def consumers(h: mx.array, y: mx.array) -> list[mx.array]:
        out = [w2.matmul(y), w2.gated_matmul(y, "silu")]
        with qweight.float32_result():
            out.append(w2.matmul(y))
        h3, y3 = w.matmul_add_norm(x, h, scale, eps) or (None, None)
        assert h3 is not None and y3 is not None
        return [*out, h3, y3, w2.gated_matmul(y3, "silu")]

    with qweight.gemv_kernel():
        hy_views = w.matmul_add_norm(x, r, scale, eps)
        assert hy_views is not None
        h, y = hy_views
        hy = qweight._packed[id(y)][1]  # the launch's one output
        packed = consumers(h, y)
        hc, yc = copy(h), copy(y)
        assert qweight._packed_source(hc) is None
        apart = consumers(hc, yc)
    assert len(packed) == len(apart) == 6
    for a, b in zip(packed, apart, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    rows_of_hy = np.array(hy.astype(mx.float32))
    assert rows_of_hy.shape == (2, rows, 1, n)
    assert np.array_equal(rows_of_hy[0], np.array(h.astype(mx.float32)))
    assert np.array_equal(rows_of_hy[1], np.array(y.astype(mx.float32)))


@cuda
def test_q4_program_fold_modes_match_fold_off(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4 Qwen3 in float32: the decode steps with the add+RMSNorm in the producing GEMVs'
    epilogue ("epilogue") against the separate add+RMSNorm kernel ("0"): logits rel <= 1e-4
    over 8 steps, the same greedy tokens. And what a step launches: the epilogue removes the
    2 add+norm launches a layer."""
    from fuselm.runtime_metal.cuda_kernels import embedding as kernels_embedding
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    out = _q4_qwen3(tmp_path, seed=7)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 384, 40)]
    logits, tokens, per_step = {}, {}, {}
    launches: collections.Counter[str] = collections.Counter()
    for module, name in ((kernels_q4, "q4_gemv"), (kernels_q4, "q4_gemv_add_norm"),
                         (kernels_embedding, "q4_take_rows")):
        real = getattr(module, name)

        def counted(*a: object, _real=real, _name=name, **kw: object) -> object:  # noqa: ANN001
            launches[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    for fold in ("0", "epilogue"):
        engine = make_engine(out, "mlx", RuntimeConfig(kernels="on", fold_norm=fold))
        program = engine.fast.program
        assert program.fold_norm is (fold == "epilogue")
        producers = sum(o.norm_producer is not None for o in program.ops)
        # each layer's two (the last one feeds the final norm)
        assert producers == (2 * program.num_layers if fold != "0" else 0)
        launches.clear()
        tokens[fold] = generate(engine, prompt, max_new_tokens=16).tokens
        # the kernels' Python calls happen as mx.compile traces a decode step (once per
        # shape); the embedding lookup runs once a traced step
        traces = launches.pop("q4_take_rows")
        assert traces >= 1 and all(n % traces == 0 for n in launches.values())
        per_step[fold] = {k: n // traces for k, n in launches.items()}
        engine.reset()
        engine.reserve(len(prompt) + 8)
        engine.forward(np.asarray([prompt]))
        logits[fold] = np.stack([np.array(engine.decode_step(mx.array(t, mx.int32)))
                                 for t in tokens[fold][:8]])
    layers = program.num_layers
    gemvs = per_step["0"]["q4_gemv"]  # q/k/v, o_proj, gate/up, down a layer (+ the LM head)
    assert gemvs >= 4 * layers and set(per_step["0"]) == {"q4_gemv"}
    assert per_step["epilogue"] == {"q4_gemv_add_norm": 2 * layers, "q4_gemv": gemvs - 2 * layers}
    assert rel(logits["epilogue"], logits["0"]) <= 1e-4
    assert tokens["epilogue"] == tokens["0"]
