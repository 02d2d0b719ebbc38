"""Reading files a user hands fuselm: regular files only, and JSON with its nesting bounded.

A FIFO (or a device) named `model.safetensors`, `config.json` or `x.gguf` blocks the first
`open()` forever, and a directory under a file's name fails deep inside a reader; so a file is
opened with O_NONBLOCK (opening a FIFO never waits) and checked with fstat on the opened
descriptor (no window between the check and the read), then read as usual.

Python's json parser recurses once per nesting level: 100,000 nested brackets raise
RecursionError from json.loads, and a structure a few hundred levels deep parses but then
overflows whatever walks it next (copy.deepcopy in transformers, pydantic, json.dumps). No file
fuselm reads nests beyond a dozen levels, so anything deeper than MAX_DEPTH is refused here.
The depth is measured on the parsed value without recursion.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from fuselm.errors import FuselmError

MAX_DEPTH = 64  # JSON nesting levels; tokenizer.json, the deepest file read, uses about 8


class NotRegularFile(FuselmError):
    """A path that names a FIFO, a directory, a device or a socket where a file belongs."""


class JSONTooDeep(ValueError):
    """JSON nested deeper than MAX_DEPTH levels."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def not_regular(path: Path, mode: int) -> NotRegularFile:
    return NotRegularFile(f"{path} is {_kind(mode)}, not a regular file; pass the file itself")


def check_regular(path: str | Path) -> None:
    """Raise NotRegularFile when `path` (links followed) exists but is not a regular file.
    A missing path is left to the caller, which knows what to say about it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise not_regular(Path(path), mode)


def open_regular(path: str | Path) -> BinaryIO:
    """`open(path, "rb")` that refuses anything but a regular file without blocking on it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(Path(path), mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str | Path) -> str:
    with open_regular(path) as f:
        return f.read().decode("utf-8")


def depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, `[]` is 1), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        level += 1
        deepest = max(deepest, level)
        stack.extend((v, level) for v in item if isinstance(v, dict | list))
    return deepest


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, raising JSONTooDeep instead of RecursionError (or a value too deep to use)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONTooDeep(f"JSON nested deeper than {max_depth} levels") from None
    if depth(value) > max_depth:
        raise JSONTooDeep(f"JSON nested deeper than {max_depth} levels")
    return value


def load_file(path: str | Path, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in the regular file `path` (see `loads`)."""
    return loads(read_text(path), max_depth)
