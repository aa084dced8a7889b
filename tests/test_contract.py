"""The bus contract is one table (bus_schema.contract): the code may use no
subject outside it, and serving, calling, authorisation and the schema read it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gearshift.bus import auth
from gearshift.bus.client import call
from gearshift.bus.server import Endpoint, check_endpoint
from gearshift.bus_schema import contract
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobRef, NodeList, SubmitRequest
from gearshift.bus_schema.schema import bus_schema

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ["services", "agent", "gearshift", "bus", "bus_schema", "loadtest", "examples", "policies", "sim", "perfmodel"]
# 'gs.' then tokens; f-string holes become <var>
_SUBJECT = re.compile(r"^gs\.[A-Za-z0-9_<>*.\-]+$")


def _literal_subjects(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants and f-strings that look like bus subjects."""
    out = []
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in parts:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "<var>" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if _SUBJECT.match(text):
            out.append((node.lineno, text))
    return out


def test_every_subject_in_the_code_is_in_the_table():
    unknown = []
    checked = 0
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for line, text in _literal_subjects(tree):
                # a prefix such as "gs.agent.<var>" is completed by the caller: it must lead somewhere
                pattern = text.rstrip(".")
                checked += 1
                if not (contract.matches_any(pattern) or _is_prefix(pattern)):
                    unknown.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert checked >= 10
    assert not unknown, "subjects not in bus_schema.contract:\n" + "\n".join(unknown)


def _is_prefix(pattern: str) -> bool:
    """``gs.admission``: a service's namespace that table rows start with."""
    toks = pattern.split(".")
    return any(r.subject.split(".")[: len(toks)] == toks and len(r.subject.split(".")) > len(toks)
               for r in contract.ROUTES)


def test_constants_of_subjects_module_are_in_the_table():
    for name in dir(subj):
        value = getattr(subj, name)
        if isinstance(value, str) and value.startswith("gs.") and name.isupper():
            assert contract.matches_any(value) or _is_prefix(value), f"subjects.{name} = {value}"


def test_the_scan_catches_an_unknown_subject():
    tree = ast.parse('x = "gs.optimizer.frobnicate"\ny = f"gs.agent.{n}.reboot"\nz = f"gs.agent.{n}.stop"')
    found = [t for _, t in _literal_subjects(tree)]
    assert found == ["gs.optimizer.frobnicate", "gs.agent.<var>.reboot", "gs.agent.<var>.stop"]
    assert [contract.matches_any(t) for t in found] == [False, False, True]


def test_the_issue_subjects_are_in_the_table_and_schema():
    subjects = bus_schema()["subjects"]
    for s in ("gs.optimizer.reconfigure", "gs.optimizer.kick", "gs.agent.<node>.checkpoint", "gs.agent.<node>.profile",
              "gs.profiler.profile", "gs.profiler.status", "gs.optimizer.node", "gs.agent.<node>.logs"):
        assert s in subjects, s
    assert subjects["gs.profiler.profile"]["request"] == "ProfileRequest"
    assert subjects["gs.optimizer.reconfigure"]["callers"] == ["admin"]
    assert subjects["gs.admission.submit.<tenant>"]["callers"] == ["admin", "tenant"]
    comps = bus_schema()["components"]["schemas"]
    for t in ("ProfileRequest", "ProfileReply", "ProfilerStatus", "NodeModeRequest", "LogsReply", "ReconfigureRequest",
              "CheckpointCommand", "ProfileCommand"):
        assert t in comps, t
    # every request/reply type the table names has a schema
    for entry in subjects.values():
        for key in ("request", "reply", "message"):
            name = entry.get(key)
            if name and not name.startswith("<"):
                assert name in comps, (entry, name)


def test_permissions_follow_the_table():
    idents = {i.user: i for i in auth.identities(["node0"], ["nlp"])}
    tenant = auth.permissions(idents["tenant-nlp"])
    assert sorted(tenant["publish"]["allow"]) == sorted(f"gs.admission.{v}.nlp" for v in ("submit", "cancel", "get",
                                                                                          "list", "usage"))
    agent = auth.permissions(idents["agent-node0"])
    assert "gs.node.node0.heartbeat" in agent["publish"]["allow"]
    assert "gs.agent.node0.logs" in agent["subscribe"]["allow"]
    assert not any(s.startswith("gs.agent.*") for s in agent["subscribe"]["allow"])
    opt = auth.permissions(idents["optimizer"])
    assert "gs.optimizer.reconfigure" in opt["subscribe"]["allow"] and "gs.agent.*.stop" in opt["publish"]["allow"]
    tools = auth.permissions(idents["tools"])
    assert "$JS.ACK.GS_EVENTS.>" in tools["publish"]["allow"]
    assert not any(s.startswith("gs.") for s in tools["publish"]["allow"])  # read-only on the bus
    # a row's callers are exactly who gets to publish it
    for r in contract.ROUTES:
        if r.kind != contract.REQUEST:
            continue
        for user, ident in idents.items():
            if ident.role == "admin":
                continue
            pub = auth.permissions(ident)["publish"]["allow"]
            concrete = contract._concrete(r.subject, ident.node, ident.tenant, ident.role in ("agent", "tenant"))
            assert (concrete in pub) == (ident.role in r.senders), (user, r.subject)


def test_serve_refuses_an_endpoint_outside_the_table():
    async def h(_):
        return None

    check_endpoint(Endpoint("get", subj.ADMISSION_GET, JobRef, h))
    check_endpoint(Endpoint("get-tenant", subj.ADMISSION_GET + ".*", JobRef, h))
    with pytest.raises(ValueError, match="not in the bus contract"):
        check_endpoint(Endpoint("x", "gs.admission.frobnicate", JobRef, h))
    with pytest.raises(ValueError, match="differs"):
        check_endpoint(Endpoint("get", subj.ADMISSION_GET, SubmitRequest, h))


async def test_call_takes_the_reply_type_from_the_table(nc):
    from gearshift.services.admission import start_admission

    _, svc = await start_admission(nc)
    try:
        reply = await call(nc, subj.ADMISSION_NODES, None)
        assert isinstance(reply, NodeList)
        with pytest.raises(ValueError, match="not a request subject"):
            await call(nc, "gs.node.x.heartbeat", None)
    finally:
        await svc.stop()
