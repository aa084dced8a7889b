"""loadtest.parity: the live optimizer and the simulator decide alike on one trace."""

from __future__ import annotations

import json

import pytest

from gearshift.sim.loaders import load_named


def test_resampled_workload_is_seeded_and_keeps_arrivals():
    base = load_named("rubick-base")
    a, b, c = (load_named(f"rubick-base:resample={s}") for s in (1, 1, 2))
    assert [j.job_id for j in a.jobs] == [j.job_id for j in b.jobs]
    assert [j.job_id for j in a.jobs] != [j.job_id for j in c.jobs]
    assert sorted(j.submit for j in a.jobs) == sorted(j.submit for j in base.jobs)
    assert {j.truth_key for j in a.jobs} <= {j.truth_key for j in base.jobs}
    with pytest.raises(ValueError, match="integer"):
        load_named("rubick-base:resample=x")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_parity_small_trace(capsys):
    from loadtest.parity import main

    rc = main(["--json", "--jobs", "6"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["finished_live"] == doc["finished_sim"] == 6
    assert doc["agree_share"] >= 0.95 and rc == 0
    assert all(d["cause"] for d in doc["disagreements"])
