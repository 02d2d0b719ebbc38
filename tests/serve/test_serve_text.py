"""Stop strings and hold-back in the server's text stream (no model: a fixed id -> text table)."""

from __future__ import annotations

from fuselm.converter.serve.text import TextStream

PIECES = ["Hel", "lo", " wo", "rld", "!", " E", "ND", " more"]


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def run(stop: list[str]) -> tuple[list[str], TextStream]:
    ts = TextStream(decode, stop)
    out = []
    for i in range(len(PIECES)):
        out.append(ts.push(i))
        if ts.stopped:
            break
    out.append(ts.flush())
    return out, ts


def test_no_stop_passes_everything_through() -> None:
    out, ts = run([])
    assert out[:3] == ["Hel", "lo", " wo"] and "".join(out) == "".join(PIECES)
    assert not ts.stopped


def test_stop_spanning_tokens_is_cut_and_never_sent() -> None:
    out, ts = run([" END"])
    assert ts.stopped and "".join(out) == "Hello world!"
    assert " E" not in "".join(out)
    assert out[5] == ""  # " E" was held back: it could have been the start of " END"


def test_partial_match_that_fails_is_released() -> None:
    out, ts = run(["!?"])
    assert out[4] == ""  # "!" held: "!?" may follow
    assert out[5] == "! E"  # released once " E" rules the stop out
    assert not ts.stopped and "".join(out) == "".join(PIECES)


def test_incomplete_utf8_is_held_until_complete() -> None:
    def dec(ids: list[int]) -> str:  # token 1 alone is half a character; with 2 it is "é"
        return "a" + ("é" if 2 in ids else "\ufffd" if 1 in ids else "")

    ts = TextStream(dec)
    assert ts.push(0) == "a"
    assert ts.push(1) == ""
    assert ts.push(2) == "é"


def test_a_replacement_char_that_never_completes_is_released() -> None:
    ts = TextStream(lambda ids: "a\ufffd" + "".join("" for _ in ids))  # undecodable ids
    k = TextStream.MAX_PARTIAL
    out = [ts.push(i) for i in range(k + 1)]
    # held for k - 1 tokens (a 4-byte character's first 3), released on the k-th
    assert out[0] == "a" and out[1:k - 1] == [""] * (k - 2) and out[k - 1] == "\ufffd"
    assert "".join(out) == "a\ufffd"
