"""Authorisation: one NATS user per role, against real processes.

The full suite (``loadtest.authz``: every forbidden action of every role
refused, every allowed one working) runs on a local cluster with
authorisation on; the tenant endpoints of admission are also checked on a
plain server, where they must hold by themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gearshift.bus import auth
from gearshift.bus.client import ServiceCallError, call
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobList, JobRecord, JobSpec, ListRequest, SubmitReply, SubmitRequest

SPEC = {"name": "t", "model": {"name": "m", "params": 10, "layers": 2, "hidden": 64, "seq_len": 16},
        "global_batch": 4, "steps": 5, "gpus": 1, "tenant": "nlp"}


def spec(tenant: str, name: str = "t") -> JobSpec:
    return msgspec.convert({**SPEC, "tenant": tenant, "name": name}, JobSpec)


async def test_tenant_endpoints_keep_tenants_apart(nc):
    from gearshift.services.admission import start_admission

    _, svc = await start_admission(nc)
    try:
        mine = (await call(nc, subj.ADMISSION_SUBMIT + ".nlp", SubmitRequest(spec=spec("nlp")), SubmitReply)).job_id
        theirs = (await call(nc, subj.ADMISSION_SUBMIT, SubmitRequest(spec=spec("vision")), SubmitReply)).job_id
        with pytest.raises(ServiceCallError) as e:
            await call(nc, subj.ADMISSION_SUBMIT + ".nlp", SubmitRequest(spec=spec("vision")), SubmitReply)
        assert e.value.code == "403" and e.value.field == "spec.tenant"
        assert (await call(nc, subj.ADMISSION_GET + ".nlp", {"job_id": mine}, JobRecord)).job_id == mine
        for verb in ("get", "cancel"):
            with pytest.raises(ServiceCallError) as e:
                await call(nc, f"{subj.ADMISSION}.{verb}.nlp", {"job_id": theirs}, JobRecord)
            assert e.value.code == "404"  # another tenant's job reads as absent
        other = (await call(nc, subj.ADMISSION_GET, {"job_id": theirs}, JobRecord))
        assert other.state.value == "pending"  # the refused cancel did nothing
        jobs = (await call(nc, subj.ADMISSION_LIST + ".nlp", ListRequest(), JobList)).jobs
        assert [j.job_id for j in jobs] == [mine]
        with pytest.raises(ServiceCallError) as e:
            await call(nc, subj.ADMISSION_LIST + ".nlp", ListRequest(tenant="vision"), JobList)
        assert e.value.code == "403"
    finally:
        await svc.stop()


async def test_jobs_per_tenant_limit(nc):
    from gearshift.services.admission import start_admission

    _, svc = await start_admission(nc, max_jobs_per_tenant=3)
    try:
        for i in range(3):
            await call(nc, subj.ADMISSION_SUBMIT, SubmitRequest(spec=spec("nlp", f"j{i}")), SubmitReply)
        with pytest.raises(ServiceCallError) as e:
            await call(nc, subj.ADMISSION_SUBMIT, SubmitRequest(spec=spec("nlp", "one-more")), SubmitReply)
        assert e.value.code == "429"
        await call(nc, subj.ADMISSION_SUBMIT, SubmitRequest(spec=spec("vision", "other")), SubmitReply)
    finally:
        await svc.stop()


def test_server_config_and_creds(tmp_path):
    d = auth.write_auth_dir(tmp_path / "auth", ["node0"], ["nlp"], url="nats://127.0.0.1:1")
    assert (d.config.stat().st_mode & 0o777) == 0o600
    text = d.config.read_text()
    assert "password" not in text and not any(i.seed in text for i in d.idents)  # public keys only, no secret
    for user in ("admin", "tools", "dashboard", "admission", "optimizer", "agent-node0", "tenant-nlp"):
        creds = json.loads(d.creds(user).read_text())
        assert creds["inbox_prefix"] == f"_INBOX_{user}" and creds["nkey_seed"].startswith("SU")
        assert f'nkey: "{auth.public_key(creds["nkey_seed"])}"' in text
        # the seed file the nats CLI reads with --nkey
        assert d.nkey(user).read_text().strip() == creds["nkey_seed"]
        assert (d.nkey(user).stat().st_mode & 0o777) == 0o600
    assert "$KV.gs_alloc.node0.>" in text and '"gs.admission.submit.nlp"' in text


def test_dashboard_role_is_read_only():
    """The dashboard's rights come from the contract table: it reads progress,
    events and watches gs_jobs/gs_nodes; it publishes on no bus subject and
    writes no bucket (the authz suite checks the server enforces this)."""
    from gearshift.bus_schema import contract

    perms = auth.permissions(auth.Identity("dashboard", "dashboard"))
    pub, sub = perms["publish"]["allow"], perms["subscribe"]["allow"]
    assert contract.grants("dashboard")[0] == []
    assert not any(p.startswith(("gs.", "$KV.", "$SRV.")) or p in (">", "$JS.API.>") for p in pub), pub
    assert "allow_responses" not in perms  # serves nothing
    assert {"gs.job.*.progress", "gs.evt.>", "_INBOX_dashboard.>"} == set(sub)
    assert contract.watched_buckets("dashboard") == ["gs_jobs", "gs_nodes"]
    for stream in ("GS_EVENTS", "KV_gs_jobs", "KV_gs_nodes"):
        assert f"$JS.API.CONSUMER.CREATE.{stream}" in pub  # ephemeral consumers only
    assert not any("DURABLE" in p or "DELETE" in p or "PURGE" in p or "gs_alloc" in p for p in pub), pub


async def test_nkey_seed_file_connects_and_a_stranger_is_refused(tmp_path):
    """What the nats CLI does with --nkey: sign the server's nonce with the seed file."""
    import nats

    from gearshift.bus.client import NotAuthorized, connect
    from gearshift.bus.natsd import NatsServer

    d = auth.write_auth_dir(tmp_path / "auth", ["node0"], ["nlp"])
    server = NatsServer(tmp_path / "js", config=d.config)
    url = server.start()
    try:
        nc = await nats.connect(url, nkeys_seed=str(d.nkey("tools")), inbox_prefix="_INBOX_tools",
                                allow_reconnect=False)
        await nc.close()
        with pytest.raises(NotAuthorized, match="refused the credentials"):
            await connect(url, retry_for=3, nkeys_seed_str=auth.new_user_seed(), identity="stranger")
        with pytest.raises(NotAuthorized):  # no credentials at all
            await connect(url, retry_for=3)
    finally:
        server.stop()


def test_authz_suite_on_a_cluster(tmp_path):
    """Every forbidden action of every role refused, every allowed one working."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env.pop("GEARSHIFT_CREDS", None)
    p = subprocess.run([sys.executable, "-m", "loadtest.authz", "--json"], capture_output=True, text=True, env=env,
                       timeout=110, cwd=Path(__file__).resolve().parent.parent)
    report = json.loads(p.stdout)
    assert report["failures"] == [], report["failures"]
    s = report["summary"]
    assert s["ok"] and s["forbidden_refused"] == s["forbidden_tried"] >= 50
    assert s["allowed_worked"] == s["allowed_tried"] >= 10
    assert {"agent-node0", "tenant-nlp", "tools", "dashboard", "admission"} <= set(s["roles"])


async def test_tls_from_deploy_settings(tmp_path, monkeypatch):
    """The client side of deploy/'s TLS: GEARSHIFT_TLS_CA verifies the server;
    without it the connection is refused."""
    import shutil

    from gearshift.bus.client import ServerUnavailable, connect
    from gearshift.bus.infra import ensure_infra
    from gearshift.bus.natsd import NatsServer

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=gearshift-test", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    conf = tmp_path / "tls.conf"
    conf.write_text(f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n  timeout: 2\n}}\n')
    server = NatsServer(tmp_path / "js", config=conf)
    url = server.start()
    try:
        monkeypatch.delenv("GEARSHIFT_CREDS", raising=False)
        monkeypatch.delenv("GEARSHIFT_TLS_CA", raising=False)
        with pytest.raises(ServerUnavailable):
            await connect(url, retry_for=0.5)
        monkeypatch.setenv("GEARSHIFT_TLS_CA", str(cert))
        nc = await connect(url, retry_for=3)
        try:
            await ensure_infra(nc)
            assert nc.connected_url is not None
        finally:
            await nc.close()
    finally:
        server.stop()
