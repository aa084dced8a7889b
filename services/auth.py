"""Identities and permissions: one NATS user per role (see deploy/README.md).

A credentials file is JSON: ``{"user", "password", "role", "inbox_prefix",
"tls_ca"?}``. ``connect_options`` turns the one named by ``GEARSHIFT_CREDS``
(or ``GEARSHIFT_USER``/``GEARSHIFT_PASSWORD``) into nats-py connect options;
with none of them set, it returns nothing and the connection is anonymous
(what the tests' plain servers expect).
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path
from typing import Any


def load_creds(path: str | os.PathLike) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "user" not in data or "password" not in data:
        raise ValueError(f"{path}: not a gearshift credentials file (needs user and password)")
    return data


def connect_options(creds_path: str | None = None) -> dict[str, Any]:
    path = creds_path or os.environ.get("GEARSHIFT_CREDS")
    opts: dict[str, Any] = {}
    creds: dict[str, Any] = {}
    if path:
        creds = load_creds(path)
    elif os.environ.get("GEARSHIFT_USER"):
        creds = {"user": os.environ["GEARSHIFT_USER"], "password": os.environ.get("GEARSHIFT_PASSWORD", "")}
    if creds:
        opts["user"] = creds["user"]
        opts["password"] = creds["password"]
        if creds.get("inbox_prefix"):
            opts["inbox_prefix"] = creds["inbox_prefix"]
    ca = os.environ.get("GEARSHIFT_TLS_CA") or creds.get("tls_ca")
    if ca:
        ctx = ssl.create_default_context(cafile=ca)
        opts["tls"] = ctx
    return opts
