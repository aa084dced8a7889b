"""Bad input: every request endpoint and agent command, fed random and mutated
payloads (hypothesis) over a real nats-server.

Each request must get a well-formed reply: an error (``Nats-Service-Error-Code``
header and an ``ErrorReply`` body) or a result that decodes as the endpoint's
reply type. No service may die, and an error must change nothing (the
JetStream streams behind the state it guards keep their last sequence).

``make test`` runs a small sample per endpoint; the ``slow`` run does
``GEARSHIFT_FUZZ_CASES`` (default 10,000) per endpoint, and
``GEARSHIFT_FUZZ_EXPENSIVE_CASES`` (default 1,000) for the two endpoints whose
valid requests cost seconds (a perfmodel fit, a profiling run):

    pytest -m slow tests/test_fuzz.py -s
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
from collections import Counter
from typing import Any, Callable

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gearshift.bus.client import ERROR_CODE_HEADER
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    MAX_MESSAGE_BYTES,
    AgentReply,
    ErrorReply,
    JobList,
    JobRecord,
    JobSpec,
    ModelSpec,
    NodeList,
    Plan,
    SubmitReply,
)

BODYLESS = {"admission.nodes", "optimizer.round", "optimizer.explain"}  # take no body: every payload is fine
SAMPLE = 40  # per endpoint in make test
SLOW = int(os.environ.get("GEARSHIFT_FUZZ_CASES", "10000"))
# Endpoints whose valid requests cost seconds (a perfmodel fit, a profiling
# run that starts a process) get fewer cases: 10,000 fits would take hours.
EXPENSIVE = {"gearshift.perfmodel.fit", "agent.profile"}


def cases_for(name: str, cases: int) -> int:
    if name not in EXPENSIVE:
        return cases
    return max(1, min(cases, int(os.environ.get("GEARSHIFT_FUZZ_EXPENSIVE_CASES", "1000")), cases // 10 or 1))

MODEL = {"name": "gpt2", "params": 124, "layers": 12, "hidden": 768, "seq_len": 1024}
SPEC = {"name": "fz", "model": MODEL, "global_batch": 16, "steps": 10, "gpus": 1, "tenant": "fuzz", "step_time": 0.05}


# ------------------------------------------------------------------ payloads
# Hypothesis draws a seed; a seeded generator builds the JSON from it. Far
# cheaper than recursive strategies (10,000 cases per endpoint must fit in a
# CI run) and still reproducible from the failing example.
SPECIAL_STRINGS = ["", "x" * 5000, "../../etc/passwd", "gs.>", "*", "j" * 65, "node0", "fuzz", "\u0000", "💥", "a.b",
                   "running", "pending", "-1", "1e999"]
EXTREMES = [0, -1, 1, 2**31, 2**63, 2**64 + 1, -(2**70), 1e308, -1e308, 0.5, 1e-320, True, False, None]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.15:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    if depth < 3 and r < 0.3:
        return {random_text(rng): random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}
    if r < 0.45:
        return rng.choice(EXTREMES)
    if r < 0.6:
        return rng.randint(-(2**40), 2**40)
    if r < 0.7:
        return rng.uniform(-1e9, 1e9)
    if r < 0.85:
        return random_text(rng)
    return rng.choice(SPECIAL_STRINGS)


def random_text(rng: random.Random) -> str:
    alphabet = "abcXYZ019_-. /*>$\"\\\u00e9\u4e2d\U0001F4A5\x00\n"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    if delete and isinstance(cur, dict):
        cur.pop(path[-1], None)
    elif delete and isinstance(cur, list):
        cur.pop(path[-1])
    else:
        cur[path[-1]] = value
    return obj


def mutate(rng: random.Random, bases: list[Any]) -> bytes:
    """A valid payload with 0-3 changes: a value replaced, a key removed, an
    unknown key added, a string made huge, a number made extreme."""
    obj = rng.choice(bases)
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        path = rng.choice(_paths(obj))
        kind = rng.choice(["replace", "delete", "add", "huge", "extreme"])
        if kind == "replace":
            obj = _set(obj, path, random_json(rng))
        elif kind == "delete" and path:
            obj = _set(obj, path, None, delete=True)
        elif kind == "add" and isinstance(obj, dict):
            obj = {**obj, random_text(rng) or "k": random_json(rng)}
        elif kind == "huge":
            obj = _set(obj, path, "A" * rng.choice([129, 257, 4097, 70_000]))
        elif kind == "extreme":
            obj = _set(obj, path, rng.choice(EXTREMES))
    return json.dumps(obj).encode()


RAW = [b"", b"{", b"null", b"[]", b"{}", b"\xff\xfe", b"{" * 5000, b" " * (MAX_MESSAGE_BYTES + 10)]


def payload(seed: int, bases: list[Any]) -> bytes:
    rng = random.Random(seed)
    r = rng.random()
    if r < 0.7:
        return mutate(rng, bases)  # mostly near-valid: they reach the handler
    if r < 0.85:
        return json.dumps(random_json(rng)).encode()
    if r < 0.97:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
    return rng.choice(RAW)


def payloads(bases: list[Any]) -> st.SearchStrategy[bytes]:
    return st.integers(min_value=0, max_value=2**64).map(lambda seed: payload(seed, bases))


# ------------------------------------------------------------------ a loop in a thread
class Bus:
    """A background event loop with one client, so hypothesis (sync) can drive async requests."""

    def __init__(self, url: str):
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc: Any = None
        self.run(self._connect())

    async def _connect(self) -> None:
        from gearshift.bus.client import connect
        from gearshift.bus.infra import ensure_infra

        self.nc = await connect(self.url, name="fuzz", retry_for=5)
        await ensure_infra(self.nc)

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.nc.drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def bus(nats_url):
    b = Bus(nats_url)
    yield b
    b.close()


async def _last_seqs(nc: Any, streams: list[str]) -> dict[str, int]:
    js = nc.jetstream()
    return {s: (await js.stream_info(s)).state.last_seq for s in streams}


def fuzz_endpoint(bus: Bus, subject: str, bases: list[Any], reply_type: Any, guarded: list[str], cases: int,
                  alive: Callable[[], Any], settle: Callable[[], Any] | None = None) -> Counter:
    """Send ``cases`` payloads to ``subject``; check every reply; return counts.
    ``settle`` waits for what an earlier accepted request still writes in the
    background, so that the state compared is the one this request found (a
    submit writes nothing after its reply: the leader publishes its event)."""
    counts: Counter = Counter()

    async def one(data: bytes) -> None:
        if settle is not None:
            await settle()
        before = await _last_seqs(bus.nc, guarded)
        msg = await bus.nc.request(subject, data, timeout=30)
        headers = msg.headers or {}
        if ERROR_CODE_HEADER in headers:
            err = codec.decode(msg.data, ErrorReply)  # well-formed: raises otherwise
            assert err.code == headers[ERROR_CODE_HEADER] and err.error
            assert err.code != "500", f"internal error on {data[:200]!r}: {err.error}"
            after = await _last_seqs(bus.nc, guarded)
            assert after == before, f"error {err.code} but state changed: {before} -> {after} for {data[:200]!r}"
            counts["error:" + err.code] += 1
        else:
            codec.decode(msg.data, reply_type)
            counts["result"] += 1

    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(payloads(bases))
    def run(data: bytes) -> None:
        bus.run(one(data))

    run()
    bus.run(alive())  # still answering valid requests
    return counts


def report(name: str, counts: Counter) -> None:
    total = sum(counts.values())
    print(f"fuzz {name}: {total} cases {dict(sorted(counts.items()))}")


# ------------------------------------------------------------------ the services
async def start_admission(nc: Any) -> Any:
    from gearshift.services.admission import start_admission as start

    return await start(nc, max_gpus=8, max_jobs_per_tenant=20)


async def ping(nc: Any, name: str) -> None:
    msg = await nc.request(f"$SRV.PING.{name}", b"", timeout=5)
    assert json.loads(msg.data)["name"] == name


def admission_cases(bus: Bus, cases: int) -> dict[str, Counter]:
    adm, svc = bus.run(start_admission(bus.nc))
    try:
        known = bus.run(_seed_job(bus.nc))
        ref = [{"job_id": known}, {"job_id": "jnothere"}]
        guarded = [f"KV_{subj.JOBS_BUCKET}", subj.EVENTS_STREAM]

        async def alive() -> None:
            await ping(bus.nc, "admission")
            from gearshift.bus.client import call

            await call(bus.nc, subj.ADMISSION_GET, {"job_id": known}, JobRecord)

        out = {}
        submit = [{"spec": SPEC}, {"spec": SPEC, "token": "t-1"}, {"spec": {**SPEC, "plan": {"dp": 1}}}]
        for name, subject, bases, reply in [
            ("admission.submit", subj.ADMISSION_SUBMIT, submit, SubmitReply),
            ("admission.submit.<tenant>", subj.ADMISSION_SUBMIT + ".fuzz", submit, SubmitReply),
            ("admission.cancel", subj.ADMISSION_CANCEL, ref, JobRecord),
            ("admission.cancel.<tenant>", subj.ADMISSION_CANCEL + ".fuzz", ref, JobRecord),
            ("admission.get", subj.ADMISSION_GET, ref, JobRecord),
            ("admission.get.<tenant>", subj.ADMISSION_GET + ".fuzz", ref, JobRecord),
            ("admission.list", subj.ADMISSION_LIST, [{}, {"tenant": "fuzz", "states": ["pending"], "limit": 5}],
             JobList),
            ("admission.list.<tenant>", subj.ADMISSION_LIST + ".fuzz", [{}, {"states": ["running"]}], JobList),
            ("admission.nodes", subj.ADMISSION_NODES, [{}], NodeList),
        ]:
            out[name] = fuzz_endpoint(bus, subject, bases, reply, guarded, cases, alive)
        return out
    finally:
        bus.run(svc.stop())
        bus.run(adm.close())


async def _seed_job(nc: Any) -> str:
    from gearshift.bus.client import call

    spec = msgspec.convert(SPEC, JobSpec)
    from gearshift.bus_schema.messages import SubmitRequest

    return (await call(nc, subj.ADMISSION_SUBMIT, SubmitRequest(spec=spec, token="seed"), SubmitReply)).job_id


def perfmodel_cases(bus: Bus, cases: int) -> dict[str, Counter]:
    from gearshift.services.perfmodel_service import (
        PERFMODEL_CURVE,
        PERFMODEL_FIT,
        PERFMODEL_PREDICT,
        CurveReply,
        FitReply,
        PredictReply,
        start_perfmodel,
    )

    _, svc = bus.run(start_perfmodel(bus.nc))
    try:
        res = {"gpus_per_node": [2], "cpu_threads_per_gpu": 4.0}
        plan = {"dp": 2}
        fit = [{"model": MODEL, "global_batch": 16, "samples": [
            {"plan": plan, "resources": res, "iter_ms": 100.0},
            {"plan": {"dp": 1}, "resources": {"gpus_per_node": [1]}, "iter_ms": 180.0, "fwd_ms": 50.0}]}]
        predict = [{"model": MODEL, "global_batch": 16, "plans": [plan], "resources": [res]}]
        curve = [{"model": MODEL, "global_batch": 16, "max_gpus": 8, "gpus_per_node": 4, "max_nodes": 2}]
        guarded = [f"KV_{subj.MODELS_BUCKET}"]

        async def alive() -> None:
            await ping(bus.nc, "perfmodel")

        return {
            "gearshift.perfmodel.fit": fuzz_endpoint(bus, PERFMODEL_FIT, fit, FitReply, guarded,
                                           cases_for("gearshift.perfmodel.fit", cases), alive),
            "gearshift.perfmodel.predict": fuzz_endpoint(bus, PERFMODEL_PREDICT, predict, PredictReply, guarded, cases, alive),
            "gearshift.perfmodel.curve": fuzz_endpoint(bus, PERFMODEL_CURVE, curve, CurveReply, guarded, cases, alive),
        }
    finally:
        bus.run(svc.stop())


def optimizer_cases(bus: Bus, cases: int) -> dict[str, Counter]:
    from gearshift.bus_schema.messages import ExplainReply, RoundReply
    from gearshift.services.optimizer import OPTIMIZER_RECONFIGURE, Optimizer, ReconfigureReply

    async def start() -> tuple[Any, Any, asyncio.Event]:
        opt = await Optimizer(bus.nc, interval=3600, lease_ttl=2).open()
        stop = asyncio.Event()
        task = asyncio.create_task(opt.run(stop))
        for _ in range(100):
            if opt.is_leader and opt._svc is not None:
                break
            await asyncio.sleep(0.05)
        return opt, task, stop

    opt, task, stop = bus.run(start())
    try:
        known = "jnothere"
        reconf = [{"job_id": known, "plan": {"dp": 1}}, {"job_id": known, "plan": None},
                  {"job_id": known, "plan": {"dp": 2}, "placement": [{"node": "node0", "gpus": 2}], "reason": "x"}]

        async def alive() -> None:
            await ping(bus.nc, "optimizer")

        guarded = [f"KV_{subj.JOBS_BUCKET}", f"KV_{subj.ALLOC_BUCKET}"]
        return {
            "optimizer.round": fuzz_endpoint(bus, subj.OPTIMIZER_ROUND, [{}], RoundReply, [], cases, alive),
            "optimizer.explain": fuzz_endpoint(bus, subj.OPTIMIZER_EXPLAIN, [{}], ExplainReply, [], cases, alive),
            "optimizer.reconfigure": fuzz_endpoint(bus, OPTIMIZER_RECONFIGURE, reconf, ReconfigureReply, guarded,
                                                   cases, alive),
        }
    finally:
        async def halt() -> None:
            stop.set()
            await asyncio.wait_for(task, 20)

        bus.run(halt())


def agent_cases(bus: Bus, cases: int, tmp_path: Any) -> dict[str, Counter]:
    from gearshift.agent.agent import Agent
    from gearshift.agent.probe import FakeProbe
    from gearshift.bus_schema.messages import ProfileResult

    async def start() -> Any:
        return await Agent(bus.nc, "fz0", FakeProbe(2, 2**34, "Fake", node="fz0"), tmp_path / "agent",
                           heartbeat=5, grace=1).start()

    agent = bus.run(start())
    try:
        stop = [{"job_id": "jx", "generation": 1}, {"job_id": "jx", "generation": 3, "reason": "r"}]
        ckpt = [{"job_id": "jx", "generation": 1}]
        profile = [{"run_id": "p1", "plan": {"dp": 1}, "global_batch": 8, "command": ["/bin/false"], "steps": 1}]

        async def alive() -> None:
            await ping(bus.nc, "agent-fz0")
            assert not agent.runs, "a fuzzed command left a run behind"

        guarded = [f"KV_{subj.JOBS_BUCKET}", f"KV_{subj.ALLOC_BUCKET}"]
        return {
            "agent.stop": fuzz_endpoint(bus, subj.agent_command("fz0", "stop"), stop, AgentReply, guarded, cases,
                                        alive),
            "agent.checkpoint": fuzz_endpoint(bus, subj.agent_command("fz0", "checkpoint"), ckpt, AgentReply, guarded,
                                              cases, alive),
            "agent.profile": fuzz_endpoint(bus, subj.agent_command("fz0", "profile"), profile, ProfileResult, guarded,
                                           cases_for("agent.profile", cases), alive),
        }
    finally:
        bus.run(agent.stop())


# ------------------------------------------------------------------ tests
def _check(results: dict[str, Counter], cases: int) -> None:
    for name, counts in results.items():
        report(name, counts)
        want = cases_for(name, cases)
        assert sum(counts.values()) >= want, f"{name}: only {sum(counts.values())} cases ran"
        if name not in BODYLESS:
            assert any(k.startswith("error:") for k in counts), f"{name}: no payload was refused"


def test_fuzz_admission_sample(bus):
    _check(admission_cases(bus, SAMPLE), SAMPLE)


def test_fuzz_perfmodel_sample(bus):
    _check(perfmodel_cases(bus, SAMPLE), SAMPLE)


def test_fuzz_optimizer_sample(bus):
    _check(optimizer_cases(bus, SAMPLE), SAMPLE)


def test_fuzz_agent_sample(bus, tmp_path):
    _check(agent_cases(bus, SAMPLE, tmp_path), SAMPLE)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_fuzz_admission_full(bus):
    _check(admission_cases(bus, SLOW), SLOW)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_fuzz_perfmodel_full(bus):
    _check(perfmodel_cases(bus, SLOW), SLOW)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_fuzz_optimizer_full(bus):
    _check(optimizer_cases(bus, SLOW), SLOW)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_fuzz_agent_full(bus, tmp_path):
    _check(agent_cases(bus, SLOW, tmp_path), SLOW)
