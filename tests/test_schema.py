"""The bus schema outside tools read must not drift silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import EVENT_TYPES, JobRecord, JobSpec, JobSubmitted, event_kind
from gearshift.bus_schema.schema import bus_schema

SNAPSHOT = Path(__file__).parent.parent / "schema" / "bus.json"


def test_schema_matches_checked_in_snapshot():
    current = bus_schema()
    saved = json.loads(SNAPSHOT.read_text())
    assert current == saved, "bus schema changed: run `make schema` and review the diff of schema/bus.json"


def test_cli_prints_the_schema():
    out = subprocess.run([sys.executable, "-m", "gearshift.cli", "schema"], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert doc["bus_version"] == 1
    assert {"JobSpec", "JobRecord", "Allocation", "NodeReport", "RunReport"} <= set(doc["components"]["schemas"])
    assert set(doc["events"]) == {event_kind(t) for t in EVENT_TYPES}


def test_every_event_round_trips_through_the_union():
    ev = JobSubmitted(ts=1.0, job_id="j1", seq=1, name="a", tenant="t", gpus=2)
    assert codec.decode_event(codec.encode(ev)) == ev
    with pytest.raises(msgspec.ValidationError, match="kind"):
        codec.decode_event(b'{"kind":"job.unknown","ts":1}')


def test_unknown_fields_rejected_in_specs_but_ignored_in_records():
    spec = {"name": "a", "model": {"name": "m", "params": 1, "layers": 1, "hidden": 1, "seq_len": 1},
            "global_batch": 1, "steps": 1, "gpus": 1}
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        codec.decode(json.dumps({**spec, "extra": 1}).encode(), JobSpec)
    rec = codec.decode(json.dumps({"job_id": "j1", "spec": spec, "future_field": 3}).encode(), JobRecord)
    assert rec.job_id == "j1"


def test_decoded_messages_are_not_tracked_by_the_cycle_collector():
    """Views hold tens of thousands of decoded records: the structs themselves stay out
    of the cycle collector's lists (``gc=False`` on both bases); only the lists inside do."""
    import gc

    from test_live_learning import _rec

    from gearshift.bus_schema import codec
    from gearshift.bus_schema.messages import JobRecord, NodeReport

    rec = codec.decode(codec.encode(_rec()), JobRecord)
    assert not gc.is_tracked(rec) and not gc.is_tracked(rec.spec) and not gc.is_tracked(rec.spec.model)
    node = NodeReport(node="n0", ts=1.0, gpus=[], cpus=8, memory_total=1, memory_used=0, probe="fake")
    assert not gc.is_tracked(codec.decode(codec.encode(node), NodeReport))
    # every message type inherits it: a new base or a type outside them would be tracked again
    import gearshift.bus_schema.messages as m

    types = [t for t in vars(m).values() if isinstance(t, type) and issubclass(t, msgspec.Struct)
             and t.__module__ == m.__name__]
    assert types and all(not t.__struct_config__.gc for t in types)
