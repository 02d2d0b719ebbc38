"""chat_window.fit, the one rule that cuts a conversation to the context window (the server's
chat completions and `fuselm chat`): the leading system/developer messages and the last turn
are kept, the oldest turns are dropped whole, the fewest that make it fit."""

from __future__ import annotations

import random

from fuselm.runtime_metal.chat_window import Message, fit, turns


def render(messages: list[Message]) -> list[int]:
    """A stand-in template: 3 tokens of framing per message, one token per word."""
    out: list[int] = []
    for m in messages:
        out += [0, 1, 2] + [7] * len(m["content"].split())
    return out + [9]  # the generation prompt


def msg(role: str, words: int, tag: str = "") -> Message:
    return {"role": role, "content": " ".join([tag or role] * words)}


def brute_force(messages: list[Message], window: int, reply: int) -> list[Message]:
    """The rule read literally: try dropping 0, 1, 2, ... oldest turns."""
    head, body = turns(messages)
    for drop in range(len(body)):
        kept = head + [m for t in body[drop:] for m in t]
        if len(render(kept)) + reply <= window:
            return kept
    return head + (body[-1] if body else [])


def test_nothing_is_dropped_when_it_fits() -> None:
    conv = [msg("system", 5), msg("user", 10), msg("assistant", 10), msg("user", 4)]
    calls: list[int] = []

    def counted(m: list[Message]) -> list[int]:
        calls.append(len(m))
        return render(m)

    need = len(render(conv))
    got = fit(conv, counted, need + 8, 8)
    assert got.messages == conv and got.dropped_messages == got.dropped_turns == 0
    assert got.tokens == render(conv) and calls == [4]  # one rendering, no search


def test_keeps_the_system_prompt_and_the_last_turns_that_fit() -> None:
    conv = [msg("system", 6, "s"), msg("user", 20, "u1"), msg("assistant", 20, "a1"),
            msg("user", 20, "u2"), msg("assistant", 20, "a2"), msg("user", 5, "u3")]
    last_two = [conv[0], *conv[3:]]
    window = len(render(last_two)) + 16  # room for the last two turns and a 16-token reply
    got = fit(conv, render, window, 16)
    assert got.messages == last_two
    assert (got.dropped_turns, got.dropped_messages) == (1, 2)
    assert got.tokens == render(last_two)
    # one token less of room: the second-to-last turn goes too
    got = fit(conv, render, window - 1, 16)
    assert got.messages == [conv[0], conv[5]] and got.dropped_messages == 4


def test_tool_messages_go_with_their_turn_and_every_leading_system_message_stays() -> None:
    conv = [msg("system", 3, "s"), msg("developer", 3, "d"), msg("user", 10, "u1"),
            msg("assistant", 10, "call"), msg("tool", 10, "result"), msg("assistant", 10, "a1"),
            msg("user", 4, "u2")]
    got = fit(conv, render, len(render([*conv[:2], conv[6]])) + 1, 1)
    assert got.messages == [conv[0], conv[1], conv[6]]
    assert (got.dropped_turns, got.dropped_messages) == (1, 4)


def test_a_last_turn_too_long_alone_is_returned_for_the_caller_to_refuse() -> None:
    conv = [msg("system", 3), msg("user", 10), msg("assistant", 10), msg("user", 50, "long")]
    got = fit(conv, render, 40, 4)
    assert got.messages == [conv[0], conv[3]] and got.dropped_messages == 2
    assert len(got.tokens) + 4 > 40


def test_the_search_finds_what_trying_every_cut_in_order_finds() -> None:
    rng = random.Random(0)
    for _ in range(300):
        conv = [msg("system", rng.randint(1, 8))] if rng.random() < 0.7 else []
        for _ in range(rng.randint(1, 9)):
            conv.append(msg("user", rng.randint(1, 30)))
            for _ in range(rng.randint(0, 2)):
                conv.append(msg(rng.choice(["assistant", "tool"]), rng.randint(1, 30)))
        if conv[-1]["role"] != "user":
            conv.append(msg("user", rng.randint(1, 10)))
        window, reply = rng.randint(10, 300), rng.randint(1, 40)
        got = fit(conv, render, window, reply)
        want = brute_force(conv, window, reply)
        assert got.messages == want and got.tokens == render(want)
        assert got.dropped_messages == len(conv) - len(want)
