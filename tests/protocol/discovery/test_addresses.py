"""``HOST:PORT`` splitting, the one home of it (``protocol/discovery/addresses.py``): what each form
reads as, and that reading it loads no networking library (the node's configuration reads it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protocol.discovery.addresses import (
    bracket_host,
    join_host_port,
    local_dial_address,
    parse_host_port,
    split_host_port,
)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("node-7.example.org:0", ("node-7.example.org", 0)),
        ("[::1]:65535", ("::1", 65535)),
        ("[::]:4100", ("::", 4100)),
        (
            ":8000",
            ("", 8000),
        ),  # an empty host: what it means is the caller's (a listen address: every interface)
        ("127.0.0.1", None),
        ("127.0.0.1:", None),
        ("127.0.0.1:65536", None),
        ("127.0.0.1:-1", None),
        ("127.0.0.1:port", None),
        ("127.0.0.1:²", None),  # a digit to str.isdigit that int() refuses
    ],
)
def test_split_host_port(text: str, expected: tuple[str, int] | None) -> None:
    assert split_host_port(text) == expected


@pytest.mark.timeout(10)
def test_parse_host_port_names_the_flag_and_reads_an_empty_host_only_when_told_what_it_means() -> None:
    assert parse_host_port("[::1]:80", flag="--listen") == ("::1", 80)
    assert parse_host_port(":80", flag="--listen", empty_host="0.0.0.0") == ("0.0.0.0", 80)
    assert parse_host_port(":80", flag="--listen", empty_host="") == ("", 80)
    assert parse_host_port("10.0.0.2:80", flag="--listen", empty_host="0.0.0.0") == ("10.0.0.2", 80)
    for bad in (":80", "10.0.0.2", "10.0.0.2:70000", "[]:80"):
        with pytest.raises(ValueError, match=r"^--dht-listen must be HOST:PORT \(or \[IPV6\]:PORT\)"):
            parse_host_port(bad, flag="--dht-listen")


@pytest.mark.timeout(10)
def test_a_split_address_joins_back_to_itself() -> None:
    for text in ("127.0.0.1:8000", "[::1]:0", "[fe80::1]:4100", "node.example:1"):
        host_port = split_host_port(text)
        assert host_port is not None
        assert join_host_port(*host_port) == text
    assert bracket_host("::1") == "[::1]" and bracket_host("10.0.0.2") == "10.0.0.2"
    assert bracket_host("[::1]") == "[::1]"  # already bracketed (a listen host as written)


@pytest.mark.timeout(10)
def test_a_wildcard_listen_host_is_dialled_on_loopback() -> None:
    for wildcard in ("", "0.0.0.0", "::", "[::]"):
        assert local_dial_address(wildcard, 7000) == "127.0.0.1:7000"
    assert local_dial_address("10.0.0.2", 7000) == "10.0.0.2:7000"
    assert local_dial_address("::1", 7000) == local_dial_address("[::1]", 7000) == "[::1]:7000"


@pytest.mark.timeout(60)
def test_reading_addresses_loads_neither_hivemind_nor_torch() -> None:
    """``node/config.py`` and ``dtnode health`` split addresses here; a health check runs every few
    seconds in a container and must not pay for the DHT's imports."""
    code = (
        "import sys; import protocol.discovery.addresses, node.config, node.ops.health; "
        "print(sorted(name for name in ('hivemind', 'torch') if name in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=50
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
