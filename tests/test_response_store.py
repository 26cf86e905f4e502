"""The Responses API's store (frontend/response_store.py), against hand-counted bytes: a chain of
turns counts each shared message once (it had counted a turn's whole conversation again for
every turn, so one long chain evicted everyone else's responses), a response past the bound
alone is not stored and evicts nothing, and the count bound still takes the oldest first."""

from __future__ import annotations

from typing import Any

from frontend.response_store import ResponseStore, json_bytes


def body(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "output": []}


def message(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_a_chain_counts_each_message_once() -> None:
    store = ResponseStore(max_bytes=10_000)
    other = [message("unrelated")]
    store.put(body("other"), other)
    history: list[dict[str, Any]] = []
    for turn in range(8):  # each turn continues the last: its history is the last one's, + 1
        history = [*history, message("x" * 600 + str(turn))]
        assert store.put(body(f"turn{turn}"), history)
    expected = sum(json_bytes(m) for m in [*other, *history])
    expected += sum(json_bytes(body(i)) for i in ["other", *(f"turn{t}" for t in range(8))])
    assert store.stored_bytes == expected  # under 10,000; counted per turn it was ~22,000
    assert store.get("other") is not None and len(store) == 9
    # The first turns go; their messages stay counted while a later turn holds them.
    for turn in range(7):
        store.delete(f"turn{turn}")
    assert store.stored_bytes == expected - sum(json_bytes(body(f"turn{t}")) for t in range(7))
    store.delete("turn7")
    store.delete("other")
    assert store.stored_bytes == 0 and len(store) == 0


def test_a_response_past_the_bound_alone_is_not_stored_and_evicts_nothing() -> None:
    store = ResponseStore(max_bytes=1_000)
    assert store.put(body("small"), [message("hi")])
    before = store.stored_bytes
    assert not store.put(body("huge"), [message("y" * 2_000)])
    assert store.get("huge") is None and store.get("small") is not None
    assert store.stored_bytes == before


def test_the_bounds_take_the_oldest_first() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for name in ("a", "b", "c"):
        store.put(body(name), [message(name)])
    assert [store.get(n) is not None for n in ("a", "b", "c")] == [False, True, True]
    tight = ResponseStore(max_bytes=2 * (json_bytes(body("a")) + json_bytes(message("a"))))
    for name in ("a", "b", "c"):
        assert tight.put(body(name), [message(name)])
    assert tight.get("a") is None and tight.get("c") is not None
