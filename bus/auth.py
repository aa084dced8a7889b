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
- ``tools``: may only read: the event stream (replay, live, and durable
  consumers of its own that resume after a restart) and live progress.
- ``dashboard``: the web dashboard's own reading: live progress, the event
  stream (ephemeral consumers only) and watches of the KV buckets the bus
  contract lets it watch (``gs_jobs``, ``gs_nodes``). It writes nothing and
  calls no endpoint: an action (cancel) runs on a connection opened with the
  signed-in person's own credentials.
- ``admin``: the operator (and ``gearshift up``'s local user): everything.

Every user gets its own reply-inbox prefix (``_INBOX_<user>``) and may only
subscribe there, so nobody reads anybody else's replies.

Identities are NATS nkeys (Ed25519 key pairs): the server config holds only
each user's public key, never a password, and proves a client by a signed
nonce. Each identity gets two files, both mode 0600:

- ``<user>.nk``: its nkey seed, what the ``nats`` CLI reads
  (``nats --nkey <user>.nk --inbox-prefix _INBOX_<user> ...``);
- ``<user>.creds``: the gearshift credentials (what ``GEARSHIFT_CREDS``
  names; deploy/'s systemd units and Secrets carry it), JSON ``{"user", "role",
  "nkey_seed", "inbox_prefix", "tenant"?, "node"?, "url"?, "tls_ca"?}``.

``connect_options`` turns the file named by ``GEARSHIFT_CREDS`` (or
``GEARSHIFT_USER``/``GEARSHIFT_PASSWORD`` for a server with password users)
into nats-py connect options; with none set the connection is anonymous
(what the tests' plain servers expect).
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gearshift.bus_schema import contract
from gearshift.bus_schema import subjects as subj

ACCOUNT = "GEARSHIFT"
SERVICE_ROLES = ("admission", "optimizer", "perfmodel", "profiler")
TENANT_VERBS = ("submit", "get", "cancel", "list")


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


def new_user_seed() -> str:
    """A fresh NATS user nkey seed (``SU...``)."""
    import nkeys

    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def public_key(seed: str) -> str:
    """The public key (``U...``) of a user seed: what the server config holds."""
    import nkeys

    kp = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


@dataclass
class Identity:
    user: str
    role: str
    seed: str = field(default_factory=new_user_seed, repr=False)
    tenant: str | None = None
    node: str | None = None

    @property
    def public_key(self) -> str:
        return public_key(self.seed)

    def creds(self, url: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"user": self.user, "role": self.role, "nkey_seed": self.seed,
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
    """The NATS ``permissions`` block of one identity: its rights on the bus
    subjects come from the contract table (``bus_schema.contract``); what is
    added here are the JetStream API, KV and inbox rights of its role."""
    if ident.role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if ident.role not in contract.ROLES:
        raise ValueError(f"unknown role {ident.role!r}")
    node = subj.token(ident.node) if ident.node else None
    tenant = subj.token(ident.tenant) if ident.tenant else None
    bus_pub, bus_sub = contract.grants(ident.role, node=node, tenant=tenant)
    inbox = inbox_prefix(ident.user) + ".>"
    srv_sub = ["$SRV.>"]
    js_api = ["$JS.API.>", "$JS.FC.>"]
    if ident.role == "admission":
        return {
            "publish": {"allow": [*js_api, _kv(subj.JOBS_BUCKET), _kv(subj.QUEUES_BUCKET), *bus_pub]},
            "subscribe": {"allow": [*bus_sub, inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "optimizer":
        return {
            "publish": {"allow": [*js_api, f"$JS.ACK.{subj.REPORTS_STREAM}.>", _kv(subj.JOBS_BUCKET),
                                  _kv(subj.ALLOC_BUCKET), _kv(subj.LEASE_BUCKET), _kv(subj.NODE_MODES_BUCKET), _kv(subj.QUEUES_BUCKET),
                                  _kv(subj.HISTORY_BUCKET), *bus_pub]},
            "subscribe": {"allow": [*bus_sub, inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "perfmodel":
        return {
            "publish": {"allow": [*js_api, _kv(subj.MODELS_BUCKET), *bus_pub]},
            "subscribe": {"allow": [*bus_sub, inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "profiler":
        return {
            "publish": {"allow": [*js_api, _kv(subj.MODELS_BUCKET), _kv(subj.JOBS_BUCKET), *bus_pub]},
            "subscribe": {"allow": [*bus_sub, inbox, *srv_sub]},
            "allow_responses": True,
        }
    if ident.role == "agent":
        n = node or ""
        alloc = f"KV_{subj.ALLOC_BUCKET}"
        nodes = f"KV_{subj.NODES_BUCKET}"
        return {
            "publish": {"allow": [
                *bus_pub, _kv(subj.NODES_BUCKET, n),
                "$JS.API.INFO", f"$JS.API.STREAM.INFO.{alloc}", f"$JS.API.STREAM.INFO.{nodes}",
                f"$JS.API.STREAM.INFO.{subj.REPORTS_STREAM}",
                # its allocations only: the server checks the filter in the subject
                f"$JS.API.CONSUMER.CREATE.{alloc}.*.$KV.{subj.ALLOC_BUCKET}.{n}.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{alloc}.*", f"$JS.API.CONSUMER.INFO.{alloc}.*",
                # other nodes' reports (the address of a multi-node job's rank 0)
                f"$JS.API.DIRECT.GET.{nodes}.>", f"$JS.API.STREAM.MSG.GET.{nodes}",
            ]},
            "subscribe": {"allow": [*bus_sub, inbox, "$SRV.PING", "$SRV.INFO", "$SRV.STATS",
                                    f"$SRV.*.agent-{n}", f"$SRV.*.agent-{n}.>"]},
            "allow_responses": True,
        }
    if ident.role == "tenant":
        return {"publish": {"allow": bus_pub}, "subscribe": {"allow": [*bus_sub, inbox]}}
    if ident.role == "dashboard":
        return {"publish": {"allow": [*_watch_rights("dashboard"), *bus_pub]},
                "subscribe": {"allow": [inbox, *bus_sub]}}
    # tools: reads the event stream, live and replayed, and may own durable
    # consumers on it (create, fetch, ack, delete). GS_EVENTS holds no
    # service's consumer, so every named consumer there is a tool's: NATS
    # permissions match whole tokens, so the stream is the prefix they own.
    ev = subj.EVENTS_STREAM
    return {
        "publish": {"allow": ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{ev}", f"$JS.API.CONSUMER.CREATE.{ev}",
                              f"$JS.API.CONSUMER.CREATE.{ev}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{ev}.*",
                              f"$JS.API.CONSUMER.MSG.NEXT.{ev}.*", f"$JS.API.CONSUMER.INFO.{ev}.*",
                              f"$JS.API.CONSUMER.DELETE.{ev}.*", f"$JS.API.CONSUMER.LIST.{ev}",
                              f"$JS.API.CONSUMER.NAMES.{ev}", f"$JS.ACK.{ev}.>",
                              f"$JS.API.STREAM.MSG.GET.{ev}", f"$JS.API.DIRECT.GET.{ev}.>", f"$JS.FC.{ev}.>",
                              *bus_pub]},
        "subscribe": {"allow": [inbox, *bus_sub]},
    }


def _watch_rights(role: str) -> list[str]:
    """JetStream API rights of a read-only watcher: for each stream it reads
    and each bucket it watches (``bus_schema.contract``), the stream's info,
    ephemeral consumers (what KV watches and ordered consumers make; the
    server refuses a durable name on this subject), their info (a KV watch
    reads its pending count) and flow control."""
    streams = [*contract.read_streams(role), *(f"KV_{b}" for b in contract.watched_buckets(role))]
    out = ["$JS.API.INFO"]
    for st in streams:
        out += [f"$JS.API.STREAM.INFO.{st}", f"$JS.API.CONSUMER.CREATE.{st}", f"$JS.API.CONSUMER.INFO.{st}.*",
                f"$JS.FC.{st}.>"]
    return out


def identities(nodes: list[str], tenants: list[str]) -> list[Identity]:
    out = [Identity("admin", "admin"), Identity("tools", "tools"), Identity("dashboard", "dashboard")]
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
            f"      # {ident.user}\n"
            f"      {{ nkey: {_q(ident.public_key)}, permissions: {{\n"
            + "\n".join(lines) + "\n      }}"
        )
    return (
        "# written by gearshift (services.auth): one nkey user per role (public keys only)\n"
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
        return self.root / f"{user}.creds"

    def nkey(self, user: str) -> Path:
        """The seed file the ``nats`` CLI takes with ``--nkey``."""
        return self.root / f"{user}.nk"


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
        _write_private(root / f"{ident.user}.creds", json.dumps(ident.creds(url), indent=2) + "\n")
        _write_private(root / f"{ident.user}.nk", ident.seed + "\n")
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
    return well_known_dir() / (first.replace(":", "_").replace("/", "_") + ".creds")


def load_creds(path: str | os.PathLike) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read credentials: {exc}") from None
    if not isinstance(data, dict) or "user" not in data or not ("nkey_seed" in data or "password" in data):
        raise ValueError(f"{path}: not a gearshift credentials file (needs user and nkey_seed)")
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
        if creds.get("nkey_seed"):
            opts["nkeys_seed_str"] = creds["nkey_seed"]
        else:  # a server with password users (GEARSHIFT_USER/GEARSHIFT_PASSWORD)
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
    deployment's server config (include it from nats-server.conf; public
    nkeys only) and per identity a credentials file and an nkey seed file;
    hand each identity's files only to its role's host."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m services.auth", description=main.__doc__)
    ap.add_argument("--out", required=True, help="folder for nats-auth.conf and the credentials (mode 0700)")
    ap.add_argument("--nodes", required=True, help="agent node names, comma-separated")
    ap.add_argument("--tenants", required=True, help="tenant names, comma-separated")
    ap.add_argument("--url", default=None, help="server URL(s) recorded in the credentials files")
    args = ap.parse_args(argv)
    d = write_auth_dir(args.out, [n for n in args.nodes.split(",") if n], [t for t in args.tenants.split(",") if t],
                       args.url)
    print(f"wrote {d.config} and {len(d.idents)} identities (<user>.creds and <user>.nk) to {d.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
