"""``loadtest.bus_costs``: every operation measured against a real nats-server, and
the watchers it counts as costs took in every message stored while they watched."""

from __future__ import annotations

from loadtest.bus_costs import costs


async def test_bus_costs_measures_every_operation_and_its_watchers_saw_each_message():
    out = await costs(ops=200, repeats=1)
    assert set(out["us_per_op"]) == {
        "stored message, acknowledgement awaited", "stored message + 1 watcher", "stored message + 2 watchers",
        *(f"stored message in an atomic batch of {n}" for n in (1, 5, 20, 100)), "core publish, no subscriber",
        "pulled message, ack explicit", "pulled message, ack all"}
    assert all(v["server"] >= 0 and v["client"] >= 0 for v in out["us_per_op"].values())
    assert out["watched"] == 200 * (1 + 2)  # one watcher for the first 200, two for the next 200
    # a commit is paid once per batch: a message alone in its batch costs the server more
    # than one among 100
    per = out["us_per_op"]
    assert per["stored message in an atomic batch of 1"]["server"] > per["stored message in an atomic batch of 100"]["server"]
