"""Fixtures: a real nats-server per test (random port, JetStream in tmp_path)."""

from __future__ import annotations

import os

import pytest

from gearshift.bus.natsd import NatsServer

os.environ.setdefault("GEARSHIFT_LOG_FORMAT", "json")
os.environ.setdefault("GEARSHIFT_LOG_LEVEL", "WARNING")


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "js")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def monitored_server(tmp_path):
    """A nats-server with its monitoring endpoint (``monitor_url``): what tests count
    messages with (``loadtest.scale.bus_counts``)."""
    server = NatsServer(tmp_path / "js-monitored", extra_args=["-m", "-1"])
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url):
    from gearshift.bus.client import connect
    from gearshift.bus.infra import ensure_infra

    client = await connect(nats_url, name="test", retry_for=2)
    await ensure_infra(client)
    yield client
    await client.drain()


def pytest_configure(config):
    from gearshift.bus.log import configure_logging

    configure_logging("json", os.environ["GEARSHIFT_LOG_LEVEL"])
