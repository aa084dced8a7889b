"""``bus.headers``: the faster header parser gives nats-py's result, on every
ASCII character in a name and on random header blocks; and it is in place."""

import random

from nats.aio.client import Client

from gearshift.bus import client as _client  # noqa: F401 (importing the bus installs it)
from gearshift.bus.headers import ORIGINAL, parse_header_lines


def test_every_ascii_character_in_a_name_and_a_value():
    for c in map(chr, range(128)):
        for raw in (f"Na{c}me: v{c}al\r\n", f"{c}Name: x\r\n", f"Name{c}: x\r\n", f"N: {c}\r\n", f"{c}\r\n"):
            data = raw.encode()
            assert parse_header_lines(data) == ORIGINAL(data), repr(raw)


def test_random_header_blocks():
    rng = random.Random(7)
    alphabet = [b"a", b"Z", b"-", b":", b" ", b"\t", b"\r\n", b"\x1c", b"\x0b", b"\xff", b"\xc3\xa9", b"1", b"_", b"\x00"]
    for _ in range(20000):
        raw = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert parse_header_lines(raw) == ORIGINAL(raw), raw


def test_what_a_fenced_kv_write_carries():
    raw = (b"Nats-Batch-Id: 5f0c\r\nNats-Batch-Sequence: 3\r\nNats-Expected-Last-Subject-Sequence: 1234\r\n"
           b"KV-Operation: DEL\r\n\r\n")
    assert parse_header_lines(raw) == ORIGINAL(raw) == {
        "Nats-Batch-Id": "5f0c", "Nats-Batch-Sequence": "3", "Nats-Expected-Last-Subject-Sequence": "1234",
        "KV-Operation": "DEL"}


def test_installed_in_every_client():
    assert Client._parse_header_lines is parse_header_lines
