"""Identities and permissions: one NATS user per role, in one account.

Roles (see ``deploy/README.md`` for the reasoning):

- ``admission``, ``optimizer``, ``perfmodel``, ``profiler``: the control
  plane. Each may use the JetStream API, write only its own buckets and
  publish only its own events and commands.
- ``agent-<node>``: publishes only ``gs.node.<node>.*``, ``gs.report.<node>.*``
  and the KV key ``gs_nodes.<node>``; receives only ``gs.agent.<node>.*`` and
  the allocations under ``gs_alloc`` keys ``<node>.*`` (a consumer whose filter
  the server checks; ``services.auth_alloc``).
- ``tenant-<t>``: may only send requests on ``gs.admission.<verb>.<t>``.
  Admission takes the tenant from the subject, which the server lets only
  that tenant's user (and the admin) publish on, so it can trust it.
- ``tools``: may only read the event stream (replay and live).
- ``admin``: the operator (and ``gearshift up``'s local user): everything.

Every user gets its own reply-inbox prefix (``_INBOX_<user>``) and may only
subscribe there, so nobody reads anybody else's replies.

A credentials file is JSON: ``{"user", "password", "role", "inbox_prefix",
"tenant"?, "node"?, "url"?, "tls_ca"?}``. ``connect_options`` turns the one
named by ``GEARSHIFT_CREDS`` (or ``GEARSHIFT_USER``/``GEARSHIFT_PASSWORD``)
into nats-py connect options; with none set the connection is anonymous
(what the tests' plain servers expect).
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus_schema import subjects as subj

ACCOUNT = "GEARSHIFT"
SERVICE_ROLES = ("admission", "optimizer", "perfmodel", "profiler")
TENANT_VERBS = ("submit", "get", "cancel", "list")


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


@dataclass
class Identity:
    user: str
    role: str
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    tenant: str | None = None
    node: str | None = None

    def creds(self, url: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"user": self.user, "password": self.password, "role": self.role,
                               "inbox_prefix": inbox_prefix(self.user)}
        if self.tenant:
            out["tenant"] = self.tenant
        if self.node:
            out["node"] = self.node
        if url:
            out["url"] = url
        return out


# ------------------------------------------------------------------ permissions
def _kv(bucket: str, key: str = ">") -> str:
    return f"$KV.{bucket}.{key}"


def permissions(ident: Identity) -> dict[str, Any]:
    """The NATS ``permissions`` block of one identity."""
    inbox = inbox_prefix(ident.user) + ".>"
    srv_sub = ["$SRV.>"]
    if ident.role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if ident.role == "admission":
        return {
            "publish": {"allow": ["$JS.API.>", "$JS.FC.>", _kv(subj.JOBS_BUCKET), "gs.evt.job.>",
                                  subj.OPTIMIZER + ".kick"]},
            "subscribe": {"allow": [subj.ADMISSION + ".>", inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "optimizer":
        return {
            "publish": {"allow": ["$JS.API.>", "$JS.FC.>", f"$JS.ACK.{subj.REPORTS_STREAM}.>", _kv(subj.JOBS_BUCKET),
                                  _kv(subj.ALLOC_BUCKET), _kv(subj.LEASE_BUCKET), _kv(subj.HISTORY_BUCKET), "gs.evt.>", "gs.agent.*.>",
                                  subj.OPTIMIZER + ".kick", subj.PERFMODEL + ".>", subj.PROFILER + ".>"]},
            "subscribe": {"allow": ["gs.>", inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "perfmodel":
        return {
            "publish": {"allow": ["$JS.API.>", "$JS.FC.>", _kv(subj.MODELS_BUCKET), "gs.evt.>"]},
            "subscribe": {"allow": [subj.PERFMODEL + ".>", inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "profiler":
        return {
            "publish": {"allow": ["$JS.API.>", "$JS.FC.>", _kv(subj.MODELS_BUCKET), _kv(subj.JOBS_BUCKET), "gs.evt.>",
                                  "gs.agent.*.>", subj.PERFMODEL + ".>", subj.OPTIMIZER + ".kick"]},
            "subscribe": {"allow": ["gs.>", inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "agent":
        n = subj.token(ident.node or "")
        alloc = f"KV_{subj.ALLOC_BUCKET}"
        nodes = f"KV_{subj.NODES_BUCKET}"
        return {
            "publish": {"allow": [
                f"gs.node.{n}.>", f"gs.report.{n}.>", _kv(subj.NODES_BUCKET, n), "gs.job.*.progress",
                "$JS.API.INFO", f"$JS.API.STREAM.INFO.{alloc}", f"$JS.API.STREAM.INFO.{nodes}",
                f"$JS.API.STREAM.INFO.{subj.REPORTS_STREAM}",
                # its allocations only: the server checks the filter in the subject
                f"$JS.API.CONSUMER.CREATE.{alloc}.*.$KV.{subj.ALLOC_BUCKET}.{n}.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{alloc}.*", f"$JS.API.CONSUMER.INFO.{alloc}.*",
                # other nodes' reports (the address of a multi-node job's rank 0)
                f"$JS.API.DIRECT.GET.{nodes}.>", f"$JS.API.STREAM.MSG.GET.{nodes}",
            ]},
            "subscribe": {"allow": [f"gs.agent.{n}.>", inbox, "$SRV.PING", "$SRV.INFO", "$SRV.STATS",
                                    f"$SRV.*.agent-{n}", f"$SRV.*.agent-{n}.>"]},
            "allow_responses": True,
        }
    if ident.role == "tenant":
        t = subj.token(ident.tenant or "")
        return {
            "publish": {"allow": [f"{subj.ADMISSION}.{verb}.{t}" for verb in TENANT_VERBS]},
            "subscribe": {"allow": [inbox]},
        }
    if ident.role == "tools":
        ev = subj.EVENTS_STREAM
        return {
            "publish": {"allow": ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{ev}", f"$JS.API.CONSUMER.CREATE.{ev}",
                                  f"$JS.API.CONSUMER.CREATE.{ev}.>", f"$JS.API.CONSUMER.MSG.NEXT.{ev}.*",
                                  f"$JS.API.CONSUMER.INFO.{ev}.*", f"$JS.API.CONSUMER.DELETE.{ev}.*",
                                  f"$JS.API.STREAM.MSG.GET.{ev}", f"$JS.API.DIRECT.GET.{ev}.>", f"$JS.FC.{ev}.>"]},
            "subscribe": {"allow": [inbox, subj.EVENTS_SUBJECTS]},
        }
    raise ValueError(f"unknown role {ident.role!r}")


def identities(nodes: list[str], tenants: list[str]) -> list[Identity]:
    out = [Identity("admin", "admin"), Identity("tools", "tools")]
    out += [Identity(role, role) for role in SERVICE_ROLES]
    out += [Identity(f"agent-{subj.token(n)}", "agent", node=n) for n in nodes]
    out += [Identity(f"tenant-{subj.token(t)}", "tenant", tenant=t) for t in tenants]
    return out


def _q(s: str) -> str:
    return json.dumps(s)


def server_config(idents: list[Identity]) -> str:
    """The ``accounts`` block of a nats-server config for these identities."""
    users = []
    for ident in idents:
        perms = permissions(ident)
        lines = [f"        publish: {{ allow: [{', '.join(_q(s) for s in perms['publish']['allow'])}] }}",
                 f"        subscribe: {{ allow: [{', '.join(_q(s) for s in perms['subscribe']['allow'])}] }}"]
        if perms.get("allow_responses"):
            lines.append("        allow_responses: true")
        users.append(
            f"      {{ user: {_q(ident.user)}, password: {_q(ident.password)}, permissions: {{\n"
            + "\n".join(lines) + "\n      }}"
        )
    return (
        "# written by gearshift (services.auth): one user per role; keep this file private\n"
        "accounts {\n"
        f"  {ACCOUNT}: {{\n"
        "    jetstream: enabled\n"
        "    users: [\n" + "\n".join(users) + "\n    ]\n"
        "  }\n"
        "}\n"
    )


@dataclass
class AuthDir:
    root: Path
    config: Path
    idents: list[Identity]

    def creds(self, user: str) -> Path:
        return self.root / f"{user}.json"


def write_auth_dir(root: str | os.PathLike, nodes: list[str], tenants: list[str], url: str | None = None) -> AuthDir:
    """Make identities, write the server config and one credentials file per
    identity (mode 0600) into ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    idents = identities(nodes, tenants)
    config = root / "nats-auth.conf"
    _write_private(config, server_config(idents))
    for ident in idents:
        _write_private(root / f"{ident.user}.json", json.dumps(ident.creds(url), indent=2) + "\n")
    return AuthDir(root, config, idents)


def set_url(auth: AuthDir, url: str) -> None:
    """Record the server URL in every credentials file (the CLI matches it)."""
    for ident in auth.idents:
        _write_private(auth.creds(ident.user), json.dumps(ident.creds(url), indent=2) + "\n")


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# ------------------------------------------------------------------ client side
def well_known_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gearshift" / "credentials"


def well_known_file(url: str) -> Path:
    """Where ``gearshift up`` leaves the admin credentials for a server URL."""
    first = url.split(",")[0].strip().removeprefix("nats://").removeprefix("tls://")
    return well_known_dir() / (first.replace(":", "_").replace("/", "_") + ".json")


def load_creds(path: str | os.PathLike) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "user" not in data or "password" not in data:
        raise ValueError(f"{path}: not a gearshift credentials file (needs user and password)")
    return data


def current_creds() -> dict[str, Any]:
    path = os.environ.get("GEARSHIFT_CREDS")
    if path:
        return load_creds(path)
    if os.environ.get("GEARSHIFT_USER"):
        return {"user": os.environ["GEARSHIFT_USER"], "password": os.environ.get("GEARSHIFT_PASSWORD", ""),
                "tenant": os.environ.get("GEARSHIFT_TENANT")}
    return {}


def connect_options(creds: dict[str, Any] | None = None) -> dict[str, Any]:
    creds = current_creds() if creds is None else creds
    opts: dict[str, Any] = {}
    if creds:
        opts["user"] = creds["user"]
        opts["password"] = creds["password"]
        if creds.get("inbox_prefix"):
            opts["inbox_prefix"] = creds["inbox_prefix"]
    ca = os.environ.get("GEARSHIFT_TLS_CA") or creds.get("tls_ca")
    if ca:
        opts["tls"] = ssl.create_default_context(cafile=ca)
    return opts


def tenant_subject(subject: str, tenant: str | None) -> str:
    """``gs.admission.submit`` -> ``gs.admission.submit.<tenant>`` for a tenant identity."""
    return f"{subject}.{subj.token(tenant)}" if tenant else subject


def main(argv: list[str] | None = None) -> int:
    """``python -m services.auth --out DIR --nodes a,b --tenants x,y``: a
    deployment's server config (include it from nats-server.conf) and one
    credentials file per identity; hand each file only to its role's host."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m services.auth", description=main.__doc__)
    ap.add_argument("--out", required=True, help="folder for nats-auth.conf and the credentials (mode 0700)")
    ap.add_argument("--nodes", required=True, help="agent node names, comma-separated")
    ap.add_argument("--tenants", required=True, help="tenant names, comma-separated")
    ap.add_argument("--url", default=None, help="server URL(s) recorded in the credentials files")
    args = ap.parse_args(argv)
    d = write_auth_dir(args.out, [n for n in args.nodes.split(",") if n], [t for t in args.tenants.split(",") if t],
                       args.url)
    print(f"wrote {d.config} and {len(d.idents)} credentials files to {d.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
