"""kernel_files: a fused kernel's text reaches MLX as an #include of a header on disk (MLX-CUDA
hashes the text it gets at every launch). Runs everywhere: the text handed over is checked
against the inline text with the system's C preprocessor; the GPU tests in test_kernels.py
run every kernel through it on MLX-CUDA."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fuselm.runtime_metal.cuda_kernels import kernel_files
from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.cuda_kernels import sources as kernels_cuda

_BODY = """  const int tid = threadIdx.x;
  float acc[4];
  #pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = x[tid * 4 + e] * kc_shape[2];
  #pragma unroll 1
  for (int e = 0; e < 4; ++e) out[tid] += acc[e];
"""
_HEAD = ("__device__ unsigned int fl_ticket = 0u;\n"
         "template <int N> __device__ int fl_n() { return N; }\n")


@pytest.fixture
def use_folder() -> Iterator[Callable[[Path | None], None]]:
    """kernel_files.use_folder (as an engine calls it with FUSELM_KERNEL_DIR's folder), the
    process's folder restored after the test."""
    before = kernel_files.kernel_dir()
    yield kernel_files.use_folder
    kernel_files.use_folder(before)


def _expanded(header: str, body: str, tmp: Path) -> list[str]:
    """The translation unit MLX would compile (header, then the kernel around the body), run
    through the C preprocessor: its tokens, pragmas as written by the preprocessor."""
    cpp = shutil.which("cpp")
    if cpp is None:
        pytest.skip("no C preprocessor (cpp) on this machine")
    unit = tmp / f"unit{len(list(tmp.glob('unit*')))}.cu"
    unit.write_text(header + "__global__ void k(const float* x, float* out) {\n" + body + "}\n")
    text = subprocess.run([cpp, "-P", "-x", "c++", str(unit)], check=True, capture_output=True,
                          text=True).stdout
    return re.findall(r"#\s*pragma[^\n]*|\w+|[^\s\w]", text)


def test_kernel_text_goes_through_a_header_file(tmp_path: Path, use_folder: Callable) -> None:
    use_folder(tmp_path / "k")
    body, head = kernel_files.mlx_text(["x", "kc"], kernels.compact_cuda(_BODY),
                                       kernels.compact_cuda(_HEAD))
    m = re.fullmatch(r'#include "([^"]+)"\n', head)
    assert m is not None
    path = Path(m.group(1))
    assert path.is_absolute() and path.parent == tmp_path / "k" and path.is_file()
    # MLX passes an input's shape only when the body it sees names it
    assert "kc_shape" in body and "x_shape" not in body
    assert len(body) + len(head) < 200  # what MLX hashes at every launch
    # the same kernel, token for token, as the inline text (pragmas included)
    inline = _expanded(kernels.compact_cuda(_HEAD), kernels.compact_cuda(_BODY), tmp_path)
    assert _expanded(head, body, tmp_path) == inline
    assert inline.count("#pragma unroll") == 1 and "#pragma unroll 1" in inline
    # content-addressed: the same text maps to the same file, other text to another
    again = kernel_files.mlx_text(["x", "kc"], kernels.compact_cuda(_BODY),
                                  kernels.compact_cuda(_HEAD))
    assert again == (body, head)
    other = kernel_files.mlx_text(["x", "kc"], kernels.compact_cuda(_BODY) + "  out[0] = 1;\n",
                                  kernels.compact_cuda(_HEAD))
    assert other[1] != head and other[0] != body


def test_real_kernels_expand_to_their_inline_text(tmp_path: Path, launches: list,
                                                  use_folder: Callable) -> None:
    """The decode step's kernel texts as the kernel modules make them (kernels.cuda_kernel
    recorded: no launch), split attention with its merge and the add+norm GEMV: through the
    file, the preprocessed text equals the inline text."""
    import mlx.core as mx

    d, hq, hk = 128, 4, 2
    qkv = mx.zeros((1, 1, (hq + 2 * hk) * d), mx.float16)
    cache = mx.zeros((1, hk, 512, d), mx.float16)
    n = mx.ones((d,), mx.float16)
    kernels_cuda.rope_attend(qkv, qkv, qkv, n, n, mx.zeros((d // 2,), mx.float32),
                             (1e-6, d ** -0.5, 1.0), mx.array([5], mx.int32), cache, cache,
                             hq=hq, hk=hk, rotary_dim=d, interleaved=False, splits=4, qkv=qkv)
    x, r = mx.zeros((1, 1, 256), mx.float16), mx.zeros((1, 1, 128), mx.float16)
    sc = mx.zeros((128, 8), mx.float16)
    kernels_q4.q4_gemv_add_norm(x, mx.zeros((128, 32), mx.uint32), sc, sc, 32, r,
                                mx.ones((128,), mx.float16), 1e-5)
    assert len(launches) == 2
    use_folder(tmp_path / "k")
    for rec in launches:
        b, h = kernels.compact_cuda(rec["source"]), kernels.compact_cuda(rec["header"])
        body, head = kernel_files.mlx_text(rec["input_names"], b, h)
        assert head.startswith("#include") and len(body) < 100
        assert _expanded(head, body, tmp_path) == _expanded(h, b, tmp_path)
    assert launches[0]["input_names"] == ["q", "qn", "kn", "inv_freq", "offset", "kc", "vc"]


def test_inline_when_asked_or_unwritable(tmp_path: Path, use_folder: Callable) -> None:
    b, h = kernels.compact_cuda(_BODY), kernels.compact_cuda(_HEAD)
    use_folder(None)
    assert kernel_files.mlx_text(["x"], b, h) == (b, h)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    use_folder(blocker / "k")
    assert kernel_files.mlx_text(["x"], b, h) == (b, h)
    # a body with a directive no macro can hold stays inline
    use_folder(tmp_path / "k")
    with_if = "#if 1\n  out[0] = 1;\n#endif\n"
    assert kernel_files.mlx_text(["x"], with_if, h) == (with_if, h)


def test_header_file_is_rewritten_when_damaged(tmp_path: Path, use_folder: Callable) -> None:
    use_folder(tmp_path)
    b, h = kernels.compact_cuda(_BODY), kernels.compact_cuda(_HEAD)
    _, head = kernel_files.mlx_text(["x"], b, h)
    path = Path(head.split('"')[1])
    good = path.read_text()
    path.write_text(good[:10])  # a truncated file from elsewhere
    kernel_files.mlx_text(["x"], b, h)
    assert path.read_text() == good
    assert not list(tmp_path.glob("*.tmp"))
