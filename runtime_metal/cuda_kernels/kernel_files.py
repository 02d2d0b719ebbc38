"""How a fused kernel's CUDA text reaches MLX: through a header file on disk, so that what MLX
hashes at every launch is a few lines rather than the kernel's whole text.

Why: MLX-CUDA hashes a custom kernel's entire source on every launch (custom_kernel.cpp,
CustomKernel::eval_gpu names its JIT module `name_<std::hash(source)>`), ~0.18 µs a KB on the
H200 host (benchmarks/host_launch_bench.py), and fuselm's kernels are 4-8 KB each: ~140 µs of
a Qwen3-0.6B decode step's ~1.2 ms, which is host-bound there (BENCHMARKS.md 'Kernels per decode
step'). So the
kernel's header and body go into `fuselm_<sha>.cuh` in a cache folder, the body as the macro
`FL_BODY_<sha>`; MLX gets `#include "<that file>"` as the header and the macro's name as the
body. NVRTC reads the file when it compiles the module (once per process and text; MLX's PTX
cache keeps the result by module name, and the file's name carries a hash of its content, so
a changed kernel never meets a stale PTX). The preprocessed kernel is the same text, token for
token: only `#pragma X` lines of the body become `_Pragma("X")` (a macro cannot hold a
directive), which is the same pragma (benchmarks/cuda_compile_check.py --compare-ptx checks the
PTX).

The folder is RuntimeConfig.kernel_dir (FUSELM_KERNEL_DIR; default $XDG_CACHE_HOME/fuselm/cuda,
else ~/.cache/fuselm/cuda), handed over by `use_folder` when an engine loads; `inline` passes
the whole text to MLX (readable NVRTC error lines when editing a kernel). Where the folder
cannot be written, the text goes inline too.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from fuselm.config import resolve

_PRAGMA = re.compile(r"^#\s*pragma\s+(.*)$")
_DIRECTIVE = re.compile(r"^\s*#")
_unwritable: set[Path] = set()  # folders that refused a write: not tried again this process
# The folder in use (None: inline text); until an engine hands one over (`use_folder`), the
# default configuration's (a kernel called outside an engine: tests, benchmarks).
_folder: list[Path | None] = []


def use_folder(folder: Path | None) -> None:
    """The folder for this process's kernel headers from now on (None: inline text)."""
    _folder[:] = [folder]


def kernel_dir() -> Path | None:
    """The folder for the kernel headers, or None for inline text."""
    if not _folder:
        use_folder(resolve().kernel_folder())
    return _folder[0]


def body_macro(body: str, macro: str) -> str | None:
    """The body (compact text: no comments, one statement line each) as `#define macro` over
    continued lines, its `#pragma X` lines as `_Pragma("X")`; None where the body holds another
    directive (#if, #define, ...: no macro can), which then stays inline."""
    lines = []
    for line in body.splitlines():
        m = _PRAGMA.match(line.strip())
        if m:
            escaped = m.group(1).replace("\\", "\\\\").replace('"', '\\"')
            line = f'_Pragma("{escaped}")'
        elif _DIRECTIVE.match(line):
            return None
        lines.append(line)
    return f"#define {macro} \\\n" + " \\\n".join(lines) + "\n"


def _write_once(path: Path, text: str) -> bool:
    """Writes text to path unless it holds it already (temp file, then rename: concurrent
    processes writing the same content never leave a half-written header)."""
    try:
        if path.is_file() and path.read_text() == text:
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def mlx_text(input_names: list[str], body: str, header: str) -> tuple[str, str]:
    """(body, header) as handed to mx.fast.cuda_kernel for a kernel of compact text `body`
    and `header`: a macro call and an #include of the file holding both (see the module doc),
    or the text itself (inline: FUSELM_KERNEL_DIR=inline, a body no macro can hold, or a
    folder that cannot be written).

    MLX passes an input's shape / strides / ndim when the body names `x_shape` etc.; the
    macro's body is in the file, so those names are repeated in a comment of the body MLX
    sees."""
    folder = kernel_dir()
    if folder is None or folder in _unwritable:
        return body, header
    sha = hashlib.sha256((header + "\0" + body).encode()).hexdigest()[:20]
    macro = f"FL_BODY_{sha}"
    defined = body_macro(body, macro)
    if defined is None:
        return body, header
    path = (folder / f"fuselm_{sha}.cuh").absolute()
    if '"' in str(path) or "\n" in str(path):
        return body, header  # no #include line can name it
    if not _write_once(path, f"#pragma once\n{header}{defined}"):
        _unwritable.add(folder)
        return body, header
    used = [f"{n}{s}" for n in input_names for s in ("_shape", "_strides", "_ndim")
            if f"{n}{s}" in body]
    mention = f"/* {' '.join(used)} */\n" if used else ""
    return f"{mention}{macro}\n", f'#include "{path}"\n'
