"""Token ids -> text deltas for one request: incremental detokenization, stop strings, and
hold-back of text that may still become a stop string or a complete UTF-8 character."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """Feed tokens one by one; each call returns the text that is safe to send now.

    Text is held back while its tail could be the start of a stop string (a stream must never
    send what a later stop would have cut), and while it ends in U+FFFD (a partial UTF-8
    sequence the next token completes)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far (up to a stop string, once one is hit)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False
        self._bad_tail = 0  # pushes for which the text has ended in U+FFFD

    # A UTF-8 character is at most 4 bytes and every token adds at least one, so a U+FFFD that
    # 4 tokens have not completed is a real replacement character (e.g. a random model's bytes),
    # not a partial one: stop holding it.
    MAX_PARTIAL = 4

    def push(self, token: int) -> str:
        self.tokens.append(token)
        self.text = self.decode(self.tokens)
        self._bad_tail = self._bad_tail + 1 if self.text.endswith("\ufffd") else 0
        # A stop string can only end in the new text; search from the earliest place it fits.
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self.flush()
        ready = len(self.text) - self._held()
        if ready <= self.sent:
            return ""
        out = self.text[self.sent:ready]
        self.sent = ready
        return out

    def flush(self) -> str:
        """The rest of the text (the request ended: nothing is pending any more)."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _held(self) -> int:
        tail = self.text[self.sent:]
        if tail.endswith("\ufffd") and self._bad_tail < self.MAX_PARTIAL:
            return len(tail) - len(tail.rstrip("\ufffd"))  # wait for the character
        held = 0
        for s in self.stop:  # the longest tail that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(tail)), held, -1):
                if tail.endswith(s[:k]):
                    held = k
                    break
        return held
