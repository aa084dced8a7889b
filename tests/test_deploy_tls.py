"""deploy/make-certs.sh: its CA and certificates serve a real nats-server over
TLS (server-only and mutual), a client that does not trust the CA or has no
certificate is refused, routes between two servers verify each other, and the
shipped deploy/nats-server.conf passes the server's own config test with them."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import nats
import pytest
from deploy_helpers import DEPLOY

from gearshift.bus import auth
from gearshift.bus.natsd import NatsServer, nats_server_binary

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def make_certs(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEPLOY / "make-certs.sh"), "-o", str(out), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tls")
    r = make_certs(out, "--names", "localhost,127.0.0.1", "--client", "tools")
    assert r.returncode == 0, r.stderr
    return out


def tls_server(tmp: Path, certs: Path, *, verify: bool = False, extra: str = "", name: str = "s") -> NatsServer:
    conf = tmp / f"{name}.conf"
    conf.write_text(
        "tls {\n"
        f'  cert_file: "{certs}/server.pem"\n  key_file: "{certs}/server-key.pem"\n  ca_file: "{certs}/ca.pem"\n'
        f"  timeout: 2\n{'  verify: true' if verify else ''}\n}}\n{extra}"
    )
    server = NatsServer(tmp / f"js-{name}", config=conf, name=name)
    server.start()
    return server


def client_context(certs: Path, cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(certs / f"{cert}.pem"), str(certs / f"{cert}-key.pem"))
    return ctx


async def roundtrip(nc) -> bytes:
    async def echo(msg):
        await msg.respond(b"pong:" + msg.data)

    sub = await nc.subscribe("gs.test.echo", cb=echo)
    reply = await nc.request("gs.test.echo", b"ping", timeout=2)
    await sub.unsubscribe()
    return reply.data


async def refused(url: str, **kw) -> bool:
    try:
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **kw)
    except Exception:
        return True
    await nc.close()
    return False


def test_script_output(certs):
    names = {p.name for p in certs.iterdir()}
    assert {"ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "route.pem", "route-key.pem",
            "tools.pem", "tools-key.pem"} <= names
    for key in certs.glob("*-key.pem"):
        assert key.stat().st_mode & 0o077 == 0, f"{key.name} is readable by others"
    text = subprocess.run(["openssl", "x509", "-in", str(certs / "route.pem"), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    assert "TLS Web Server Authentication, TLS Web Client Authentication" in text
    assert "DNS:localhost" in text and "IP Address:127.0.0.1" in text


def test_rerun_keeps_the_ca_and_bad_options_are_refused(tmp_path):
    assert make_certs(tmp_path).returncode == 0
    ca = (tmp_path / "ca.pem").read_bytes()
    r = make_certs(tmp_path, "--client", "admission")
    assert r.returncode == 0 and "reusing the CA" in r.stdout
    assert (tmp_path / "ca.pem").read_bytes() == ca
    assert subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"), str(tmp_path / "admission.pem")],
                          capture_output=True).returncode == 0
    for bad in (["--days", "soon"], ["--client", "../x"], ["--frobnicate"]):
        r = make_certs(tmp_path / "bad", *bad)
        assert r.returncode == 2 and r.stderr.startswith("make-certs.sh: "), (bad, r.stderr)


async def test_tls_server_with_the_scripts_certs(tmp_path, certs, monkeypatch):
    server = tls_server(tmp_path, certs)
    try:
        url = f"tls://localhost:{server.port}"
        # the services' own connect path: the CA from GEARSHIFT_TLS_CA
        monkeypatch.setenv("GEARSHIFT_TLS_CA", str(certs / "ca.pem"))
        from gearshift.bus.client import connect

        nc = await connect(url, name="tls-test", retry_for=3)
        assert await roundtrip(nc) == b"pong:ping"
        await nc.close()
        # by IP too: the certificate names 127.0.0.1
        nc = await nats.connect(f"tls://127.0.0.1:{server.port}", tls=client_context(certs), connect_timeout=2)
        assert await roundtrip(nc) == b"pong:ping"
        await nc.close()
        # a client that does not trust this CA is refused
        assert await refused(url, tls=ssl.create_default_context())
        # a client that would speak plain NATS is refused: the server requires TLS
        assert await refused(url.replace("tls://", "nats://"), tls=None)
    finally:
        server.stop()


async def test_mutual_tls_needs_a_client_certificate(tmp_path, certs):
    server = tls_server(tmp_path, certs, verify=True)
    try:
        url = f"tls://localhost:{server.port}"
        nc = await nats.connect(url, tls=client_context(certs, "tools"), connect_timeout=2)
        assert await roundtrip(nc) == b"pong:ping"
        await nc.close()
        assert await refused(url, tls=client_context(certs))  # no client certificate
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_routes_verify_each_other_with_the_route_certificate(tmp_path, certs):
    p1, p2 = _free_port(), _free_port()

    def cluster(port: int, peer: int) -> str:
        return (
            "cluster {\n  name: gs\n"
            f"  listen: 127.0.0.1:{port}\n  routes: [\"nats-route://localhost:{peer}\"]\n"
            f'  tls {{ cert_file: "{certs}/route.pem"\n key_file: "{certs}/route-key.pem"\n'
            f'         ca_file: "{certs}/ca.pem"\n verify: true\n timeout: 2 }}\n}}\n'
        )

    a = tls_server(tmp_path, certs, extra=cluster(p1, p2), name="a")
    b = tls_server(tmp_path, certs, extra=cluster(p2, p1), name="b")
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if any("Route connection created" in line for line in a.log + b.log):
                break
            time.sleep(0.1)
        else:
            pytest.fail("no TLS route between the servers:\n" + "".join((a.log + b.log)[-20:]))
        assert not any("TLS route handshake error" in line for line in a.log + b.log)
    finally:
        a.stop()
        b.stop()


def test_shipped_server_config_passes_the_config_test(tmp_path, certs):
    """deploy/nats-server.conf with its paths moved under tmp_path: TLS files
    from the script, the accounts from gearshift.bus.auth, JetStream's store."""
    etc = tmp_path / "etc"
    shutil.copytree(certs, etc / "tls")
    auth.write_auth_dir(etc / "auth", ["gpu-1"], ["nlp"])
    conf = (DEPLOY / "nats-server.conf").read_text()
    conf = conf.replace("/etc/gearshift/", f"{etc}/").replace("/var/lib/nats/", f"{tmp_path}/nats/")
    (etc / "nats-server.conf").write_text(conf)
    r = subprocess.run([nats_server_binary(), "-t", "-c", str(etc / "nats-server.conf")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    # and a broken path is caught by the same test (the check can fail)
    (etc / "tls" / "route.pem").unlink()
    r = subprocess.run([nats_server_binary(), "-t", "-c", str(etc / "nats-server.conf")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "route.pem" in r.stdout + r.stderr
