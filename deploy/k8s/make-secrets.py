#!/usr/bin/env python3
"""Write the Kubernetes Secrets gearshift's manifests use, from files on disk.

    python deploy/k8s/make-secrets.py --auth AUTH_DIR --tls TLS_DIR > secrets.yaml
    kubectl apply -f secrets.yaml        # then: shred secrets.yaml

AUTH_DIR holds what the credentials tool wrote: ``nats-auth.conf`` (the
server's accounts) and one ``<role>.creds`` per identity; TLS_DIR what
``deploy/make-certs.sh`` wrote. Each workload mounts only its own Secret:

=========================  ===================================  =====================
Secret                     keys                                 used by
=========================  ===================================  =====================
gearshift-creds-<role>     ``<role>.creds``                     that role's Deployment
                                                                (and each ``--role``)
gearshift-creds-agents     ``agent-<node>.creds`` per node      the agent DaemonSet
                                                                (each pod sees its own)
gearshift-nats-auth        ``nats-auth.conf``                   the NATS servers
gearshift-ca               ``ca.crt``                           everyone (trust)
nats-tls                   ``tls.crt``, ``tls.key``             NATS client port
nats-route-tls             ``tls.crt``, ``tls.key``             NATS routes
=========================  ===================================  =====================

Nothing here is written to the repository; the output holds secrets.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

ROLES = ("admission", "optimizer", "perfmodel", "profiler", "dashboard")
NAMESPACE = "gearshift"


class Missing(Exception):
    pass


def secret(name: str, files: dict[str, Path], namespace: str, kind: str = "Opaque") -> dict:
    data = {}
    for key, path in files.items():
        if not path.is_file():
            raise Missing(f"{path}: not found (needed for Secret {name}, key {key})")
        data[key] = base64.b64encode(path.read_bytes()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "gearshift"}},
        "type": kind,
        "data": data,
    }


def secrets(auth: Path, tls: Path, namespace: str = NAMESPACE, extra_roles: tuple[str, ...] = ()) -> list[dict]:
    out = [secret(f"gearshift-creds-{role}", {f"{role}.creds": auth / f"{role}.creds"}, namespace)
           for role in (*ROLES, *extra_roles)]
    agents = {p.name: p for p in sorted(auth.glob("agent-*.creds"))}
    if not agents:
        raise Missing(f"{auth}: no agent-<node>.creds files (one per GPU node)")
    out.append(secret("gearshift-creds-agents", agents, namespace))
    out.append(secret("gearshift-nats-auth", {"nats-auth.conf": auth / "nats-auth.conf"}, namespace))
    out.append(secret("gearshift-ca", {"ca.crt": tls / "ca.pem"}, namespace))
    for name, stem in (("nats-tls", "server"), ("nats-route-tls", "route")):
        out.append(secret(name, {"tls.crt": tls / f"{stem}.pem", "tls.key": tls / f"{stem}-key.pem"},
                          namespace, "kubernetes.io/tls"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make-secrets.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--auth", required=True, type=Path, help="folder with nats-auth.conf and <role>.creds files")
    ap.add_argument("--tls", required=True, type=Path, help="folder written by deploy/make-certs.sh")
    ap.add_argument("--namespace", default=NAMESPACE, help="namespace of the Secrets (default gearshift)")
    ap.add_argument("--role", action="append", default=[], metavar="ROLE",
                    help="also package ROLE.creds as gearshift-creds-ROLE (e.g. tools, for an in-cluster consumer)")
    args = ap.parse_args(argv)
    try:
        docs = secrets(args.auth, args.tls, args.namespace, tuple(args.role))
    except Missing as exc:
        print(f"make-secrets.py: error: {exc}", file=sys.stderr)
        return 1
    # a YAML stream of JSON documents (JSON is YAML): no dependency beyond the standard library
    sys.stdout.write("".join(f"---\n{json.dumps(d, indent=2)}\n" for d in docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
