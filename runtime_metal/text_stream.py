"""Token ids -> text, incrementally: the one detokenizer and stop matcher behind every face
(`fuselm run`, chat, the Python API's stream, the server).

Each token costs one decode of a short window, never of the whole reply (mlx-lm's streaming
detokenizer idea): the window is the tokens since the last place the text ended on a whole
character, plus one token before it as context, so a tokenizer that treats the first token
of a decode specially (SentencePiece drops its leading space) decodes the window as it would
the whole reply. Text is handed out only once it is final:

- a tail that decodes to U+FFFD may be a UTF-8 character cut between tokens: it waits until
  a token completes it or the stream ends (a window that grows to MAX_WINDOW tokens keeps
  only its last few, which still decode to that tail; where they do not, the tail is bytes
  that are no text, e.g. a random model's, and its replacement characters are final);
- a tail that could be the start of a stop string waits until it is known not to be one;
  text from a stop string on is never handed out, and the stream says which stop ended it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[list[int]], str]
REPLACEMENT = "\ufffd"


def detokenizer(tokenizer: Any) -> Decode:
    """The decode every stream uses: a transformers tokenizer's, special tokens skipped."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def token_text(decode: Decode, token: int) -> str:
    """One token's text as it decodes alone: what logprobs name a token by (OpenAI's `token`;
    a token holding part of a UTF-8 character shows as U+FFFD)."""
    return decode([int(token)])


class StreamingDetokenizer:
    """Feed token ids one by one; `push` returns the text that became final.

    The window's decoded text is assumed to keep, as tokens are added, the characters it
    already had before its last replacement characters (true of byte-level BPE and of
    SentencePiece with byte fallback: a later byte can only complete a cut character)."""

    # A window whose text ends in U+FFFD grows until a token completes the character; at
    # MAX_WINDOW tokens it is cut to its last KEEP (a cut character's bytes come from its last
    # few tokens: a UTF-8 character is at most 4 bytes and a token adds at least one).
    MAX_WINDOW = 32
    KEEP = 8

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []  # the window: one context token, then the pending ones
        self.sent = 0  # characters of decode(ids) already handed out (the context's included)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.decode(self.ids)
        cut = len(text) - len(text.rstrip(REPLACEMENT))  # a character maybe still incomplete
        if not cut:
            out = text[self.sent:]
            # The text ends on a whole character: what follows needs only the last token.
            self._restart(self.ids[-1:])
            return out
        ready = len(text) - cut
        out = text[self.sent:ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        if len(self.ids) >= self.MAX_WINDOW:
            held = text[self.sent:]
            keep = self.ids[-self.KEEP:]
            kept = self.decode(keep)
            if kept.endswith(held):
                self.ids, self.sent = keep, len(kept) - len(held)
            else:  # not a cut character (bytes that are no text): its U+FFFDs are final
                out += held
                self._restart(self.ids[-1:])
        return out

    def _restart(self, ids: list[int]) -> None:
        """A new window after text that is all handed out: `ids` are its context."""
        self.ids = ids
        self.sent = len(self.decode(ids))

    def flush(self) -> str:
        """The rest of the text (no token follows: a held replacement character is final)."""
        text = self.decode(self.ids) if self.ids else ""
        out = text[self.sent:]
        self.sent = len(text)
        return out


class StopMatcher:
    """Text in, text out, minus anything from the first stop string on; `hit` names it."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""  # the tail held back: a proper prefix of some stop string
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        if self.hit is not None:
            return ""
        buf = self.pending + text
        first = min(((i, n) for n, i in enumerate(buf.find(s) for s in self.stops) if i >= 0),
                    default=None)
        if first is not None:
            self.hit, self.pending = self.stops[first[1]], ""
            return buf[:first[0]]
        held = self._partial(buf)
        self.pending = buf[len(buf) - held:]
        return buf[:len(buf) - held]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), held, -1):
                if buf.endswith(s[:k]):
                    held = k
                    break
        return held


class TextStream:
    """Token ids in, final text out: a StreamingDetokenizer followed by a StopMatcher.

    `push(token)` returns the text safe to send now ("" while text is held back); after a stop
    string, `stopped` is set, `stop` names it, and later pushes return "". `finish()` returns
    the held rest when the generation ends. `text` is everything handed out."""

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._detok = StreamingDetokenizer(decode)
        self._stops = StopMatcher(stop)
        self._parts: list[str] = []

    @property
    def stopped(self) -> bool:
        return self._stops.hit is not None

    @property
    def stop(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self._stops.hit

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        return self._out(self._stops.feed(self._detok.push(token)))

    def finish(self) -> str:
        """The text still held back, now that no token follows (a stop string may still end
        it: one whose last characters were a held replacement character)."""
        if self.stopped:
            return ""
        out = self._stops.feed(self._detok.flush())
        return self._out(out + (self._stops.flush() if not self.stopped else ""))

    def _out(self, piece: str) -> str:
        if piece:
            self._parts.append(piece)
        return piece
