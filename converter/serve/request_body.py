"""A request body read as JSON, or refused with a 4xx before any handler sees it: not
application/json (415: a browser sends text/plain cross-origin without asking first), over
--max-body (413), not UTF-8 or not JSON (400), nested deeper than any OpenAI request needs or
holding a lone UTF-16 surrogate such as "\\ud800" that no tokenizer or UTF-8 writer accepts (400).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from fuselm.converter.serve.errors import ApiError

# An OpenAI body nests about six deep (messages[].content[].text); tool schemas go further.
MAX_DEPTH = 64


def check_content_type(value: str | None) -> None:
    kind, *params = (value or "").split(";")
    charset = next((p.split("=", 1)[1].strip().strip('"').lower() for p in params
                    if p.strip().lower().startswith("charset=")), "utf-8")
    if kind.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise ApiError(415, f"the request body must be JSON sent as Content-Type: "
                            f"application/json (got {value!r})", code="unsupported_media_type")


def _where(path: list[str | int]) -> str:
    # Escaped: the path may name the very key that holds the surrogate.
    text = ".".join(str(p) for p in path) or "the top level"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_plain(data: Any) -> None:
    """Depth and surrogates (in keys and values) of a parsed object or array, walked without
    recursion (the body is untrusted)."""
    todo: list[tuple[Any, list[str | int]]] = [(data, [])]
    while todo:
        value, path = todo.pop()
        if len(path) > MAX_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels (at "
                                f"{_where(path[:4])}...)", param=str(path[0]))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for text in (key, item):
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        at = _where([*path, key])
                        raise ApiError(400, f"{at}: a lone UTF-16 surrogate "
                                            f"({text[e.start]!r}) is not Unicode text; send "
                                            "valid UTF-8", param=at) from None
            if isinstance(item, dict | list):
                todo.append((item, [*path, key]))


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    check_content_type(request.headers.get("content-type"))
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body is {int(size)} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the {limit}-byte limit")
    try:
        data = json.loads(bytes(body).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 ({e.reason} at byte "
                            f"{e.start})") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} "
                            f"column {e.colno})") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        reason = str(e).split(":")[0]  # without Python's advice to the programmer
        raise ApiError(400, f"the request body holds a value out of range ({reason})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_plain(data)
    return data
