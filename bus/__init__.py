"""The bus floor: what every gearshift process that talks NATS shares.

Below ``services/`` and ``agent/`` (which are peers over it), above
``bus_schema/`` (the messages and the contract, pure):

- ``client``: connect (reconnects, one clear error), typed request-reply calls;
- ``server``: nats.micro endpoints that decode with msgspec and answer errors;
- ``infra``: the streams and KV buckets, created or updated idempotently;
- ``process``: uvloop, signals, GC tuning; ``log``: structlog set-up;
- ``clock``: the time source services take (tests inject a manual one);
- ``observe``: Prometheus metrics and health endpoints;
- ``auth``: nkey identities and the permissions made from the contract;
- ``config``: one YAML file per process, with environment and flags on top;
- ``kv``/``views``: KV snapshots and materialised views fed by watches;
- ``alloc_watch``: an agent's watch of its node's allocations;
- ``tasks``: ending background tasks (a cancellation Python 3.11 may swallow);
- ``natsd``: a local ``nats-server`` (tests, ``gearshift up``).
"""

VERSION = "0.1.0"
