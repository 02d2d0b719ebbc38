"""A conversation cut to fit the context window, by one rule (the server's chat completions and
`fuselm chat` both use it):

* the leading system (and developer) messages are always kept;
* the rest is split into turns, each starting at a user message (a non-user message before the
  first user message starts a turn of its own);
* the last turn (the message being answered) is always kept;
* the oldest turns are dropped, whole, until the rendered conversation plus the room the
  reply needs fits the window; nothing is dropped when it fits already.

When even the system messages and the last turn do not fit, they are returned as they are
(the caller refuses the prompt as too long, as without a cut)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
HEAD_ROLES = ("system", "developer")


@dataclass
class Fitted:
    messages: list[Message]  # what to render: the head and the kept turns
    tokens: list[int]  # their rendering
    dropped_turns: int = 0
    dropped_messages: int = 0


def turns(messages: Sequence[Message]) -> tuple[list[Message], list[list[Message]]]:
    """(the leading system/developer messages, the turns after them)."""
    head_len = 0
    while head_len < len(messages) and messages[head_len].get("role") in HEAD_ROLES:
        head_len += 1
    out: list[list[Message]] = []
    for m in messages[head_len:]:
        if not out or m.get("role") == "user":
            out.append([])
        out[-1].append(m)
    return list(messages[:head_len]), out


def fit(messages: Sequence[Message], render: Callable[[list[Message]], list[int]],
        window: int, reply: int) -> Fitted:
    """The longest tail of turns (with the head) whose rendering has len + reply <= window.
    `render` turns messages into prompt token ids; it is called once when everything fits,
    else about log2(turns) + 1 times (a binary search over how many turns to drop: fewer
    messages never render longer)."""
    full = render(list(messages))
    if len(full) + reply <= window:
        return Fitted(list(messages), full)
    head, body = turns(messages)

    def kept(drop: int) -> list[Message]:
        return head + [m for t in body[drop:] for m in t]

    lo, hi = 1, len(body) - 1  # the fewest turns to drop that fits is in [lo, hi]
    best: tuple[int, list[int]] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        ids = render(kept(mid))
        if len(ids) + reply <= window:
            best, hi = (mid, ids), mid - 1
        else:
            lo = mid + 1
    if best is None:  # even the last turn alone does not fit: keep it, the caller refuses
        drop = max(len(body) - 1, 0)
        best = (drop, render(kept(drop)) if drop else full)
    drop, ids = best
    return Fitted(kept(drop), ids, drop, sum(len(t) for t in body[:drop]))
