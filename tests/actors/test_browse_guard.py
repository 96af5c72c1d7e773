"""browse reaches globally routable addresses only: every special-purpose range of IANA's IPv4 and
IPv6 registries is refused, IPv6 forms that carry an IPv4 address are judged by it, a redirect to
any of them is refused before it is followed, and the whole fetch, name lookups included, has one
deadline. Names resolve through a resolver the test gives; servers listen on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiohttp.abc import AbstractResolver

from actors.browse import BrowseTool, PageError, check_address
from actors.tools import CURRENT_TRAJECTORY, TrajectoryContext
from tests.actors.web_standin import WebStandIn

REFUSED = {  # range -> addresses in it (first, inner, last); IANA's special-purpose registries
    "this network 0/8": ["0.0.0.0", "0.1.2.3", "0.255.255.255"],
    "private 10/8": ["10.0.0.1", "10.255.255.255"],
    "shared (CGNAT) 100.64/10, a cloud's metadata": [
        "100.64.0.1",
        "100.100.100.200",
        "100.127.255.254",
    ],
    "loopback 127/8": ["127.0.0.1", "127.255.255.254"],
    "link-local 169.254/16": ["169.254.0.1", "169.254.169.254"],
    "private 172.16/12": ["172.16.0.1", "172.31.255.254"],
    "IETF protocol assignments 192.0.0/24": [
        "192.0.0.1",
        "192.0.0.8",
        "192.0.0.170",
        "192.0.0.255",
    ],
    "anycast in it IANA calls global: no web page": ["192.0.0.9", "192.0.0.10"],
    "documentation": ["192.0.2.1", "198.51.100.7", "203.0.113.9"],
    "6to4 relay anycast 192.88.99/24": ["192.88.99.1", "192.88.99.2"],
    "private 192.168/16": ["192.168.0.1", "192.168.255.254"],
    "benchmarking 198.18/15": ["198.18.0.1", "198.19.255.254"],
    "multicast 224/4": ["224.0.0.1", "239.255.255.250"],
    "reserved 240/4, broadcast": ["240.0.0.1", "254.1.2.3", "255.255.255.255"],
    "unspecified, loopback": ["::", "::1"],
    "IPv4-mapped, private": [
        "::ffff:0.0.0.0",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:a9fe:a9fe",
    ],
    "IPv4-mapped, shared": ["::ffff:100.100.100.200", "::ffff:192.168.1.1"],
    "NAT64 64:ff9b::/96, private": ["64:ff9b::7f00:1", "64:ff9b::a00:1", "64:ff9b::a9fe:a9fe"],
    "NAT64 64:ff9b::/96, shared": ["64:ff9b::6464:64c8"],
    "local-use NAT64 64:ff9b:1::/48": ["64:ff9b:1::1", "64:ff9b:1:ffff::808:808"],
    "IPv4-compatible (deprecated)": ["::a00:1", "::7f00:1", "::808:808"],
    "discard-only 100::/64, dummy 100:0:0:1::/64": [
        "100::1",
        "100::ffff:ffff:ffff:ffff",
        "100:0:0:1::1",
    ],
    "Teredo 2001::/32": ["2001::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2", "2001:0:a00:1::1"],
    "IETF assignments 2001::/23": ["2001:2::1", "2001:10::1", "2001:1ff:ffff::1"],
    "global in it by IANA (anycast, AMT, AS112, ORCHIDv2)": [
        "2001:1::1",
        "2001:3::1",
        "2001:4:112::1",
        "2001:20::1",
    ],
    "documentation 2001:db8::/32, 3fff::/20": [
        "2001:db8::1",
        "2001:db8:ffff::1",
        "3fff::1",
        "3fff:fff::1",
    ],
    "6to4 2002::/16 (deprecated)": [
        "2002:7f00:1::1",
        "2002:a9fe:a9fe::1",
        "2002:a00:1::",
        "2002:808:808::1",
    ],
    "SRv6 SIDs 5f00::/16": ["5f00::1"],
    "unique local fc00::/7": ["fc00::1", "fd12:3456:789a::1"],
    "link-local fe80::/10, site-local fec0::/10": ["fe80::1", "febf::1", "fec0::1"],
    "multicast ff00::/8": ["ff02::1", "ff0e::1", "ff05::2"],
    "outside 2000::/3, the only global unicast space": ["4000::1", "8000::1", "e000::1"],
}

ALLOWED = {
    "public IPv4": ["8.8.8.8", "1.1.1.1", "93.184.215.14", "223.255.255.254"],
    "beside shared and private": ["100.63.255.255", "100.128.0.1", "172.15.255.255", "172.32.0.1"],
    "beside private and benchmarking": [
        "192.167.255.255",
        "192.169.0.1",
        "198.17.255.255",
        "198.20.0.1",
    ],
    "AS112, AMT: globally reachable": ["192.31.196.1", "192.52.193.1", "192.175.48.1"],
    "public IPv6": ["2606:4700:4700::1111", "2001:4860:4860::8888", "2a00:1450:4001:81c::200e"],
    "beside 2001::/23; AS112": ["2001:200::1", "2620:4f:8000::1"],
    "public IPv4, mapped and NAT64": ["::ffff:8.8.8.8", "64:ff9b::808:808"],
}


def verdict(address: str) -> bool:
    """Whether browse would reach `address` (as a URL's host, no allow-list)."""
    host = f"[{address}]" if ":" in address else address
    try:
        asyncio.run(check_address(f"http://{host}/", frozenset()))
    except PageError:
        return False
    return True


def test_only_globally_routable_addresses_are_browsed():
    browsed = [(r, a) for r, addresses in REFUSED.items() for a in addresses if verdict(a)]
    refused = [(r, a) for r, addresses in ALLOWED.items() for a in addresses if not verdict(a)]
    assert not browsed and not refused, f"browsed: {browsed}; refused: {refused}"


class Names(AbstractResolver):
    """Names the test answers itself (no DNS); `hang`: a lookup that never answers."""

    def __init__(self, names: dict[str, str], hang: bool = False) -> None:
        self.names, self.hang, self.asked = names, hang, []

    async def resolve(self, host, port=0, family=socket.AF_INET):
        self.asked.append(host)
        if self.hang:
            await asyncio.Event().wait()
        if host not in self.names:
            raise OSError(f"{host}: unknown to the test")
        family = socket.AF_INET6 if ":" in self.names[host] else socket.AF_INET
        address = self.names[host]
        return [
            {"hostname": host, "host": address, "port": port, "family": family}
            | {"proto": 0, "flags": 0}
        ]

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def standin():
    with WebStandIn() as server:
        yield server


def browse_once(tool: BrowseTool, url: str):
    async def call():
        token = CURRENT_TRAJECTORY.set(TrajectoryContext())
        try:  # a guard: a fetch that ignored its deadline fails here, not by hanging the suite
            return await asyncio.wait_for(tool(url), 20)
        finally:
            CURRENT_TRAJECTORY.reset(token)
            await tool.close()

    return asyncio.run(call())


@pytest.mark.parametrize(
    "target",
    [
        "http://100.100.100.200/latest/meta-data/",
        "http://[::ffff:a9fe:a9fe]/latest/meta-data/",
        "http://[64:ff9b::a9fe:a9fe]/latest/meta-data/",
        "http://[2002:a9fe:a9fe::1]/latest/meta-data/",
        "http://metadata.test/computeMetadata/v1/",  # a name that resolves to a CGNAT address
        "http://rebound.test:{port}/page.html",  # the stand-in itself, by a name not allow-listed
    ],
)
def test_a_redirect_to_an_internal_address_is_refused(standin, target):
    names = {"metadata.test": "100.100.100.200", "rebound.test": "127.0.0.1"}
    tool = BrowseTool(
        max_bytes=100_000,
        max_chars=2000,
        max_calls_per_trajectory=5,
        timeout_s=5,
        allow_hosts=(f"127.0.0.1:{standin.port}",),  # the first hop's server
        resolver=Names(names),
    )
    target = target.format(port=standin.port)
    before = standin.hits["page.html"]
    result = browse_once(tool, f"{standin.base}/to?url={target}")
    assert not result.ok and "is a loopback, private or reserved address" in result.text
    assert standin.hits["page.html"] == before and "Quorvex" not in result.text


@pytest.mark.parametrize("lookup", ["injected", "default"])
def test_a_name_lookup_that_hangs_ends_at_the_deadline(monkeypatch, lookup):
    options = {}
    if lookup == "injected":
        options["resolver"] = Names({}, hang=True)
    else:  # the production resolver, whose getaddrinfo never answers

        async def hanging_getaddrinfo(self, *args, **kwargs):
            await asyncio.Event().wait()

        monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", hanging_getaddrinfo)
    tool = BrowseTool(
        max_bytes=1000, max_chars=100, max_calls_per_trajectory=5, timeout_s=0.5, **options
    )
    begun = time.monotonic()
    result = browse_once(tool, "http://slow-dns.test/")
    took = time.monotonic() - begun
    assert not result.ok and "took longer than 0.5 s" in result.text, result.text
    assert took < 3, took


def test_all_redirect_hops_share_one_deadline(standin):
    """Five hops of 0.4 s each, every one well inside the limit, are cut at 1 s all together."""
    tool = BrowseTool(
        max_bytes=100_000,
        max_chars=2000,
        max_calls_per_trajectory=5,
        timeout_s=1.0,
        allow_hosts=(f"127.0.0.1:{standin.port}",),
    )
    begun = time.monotonic()
    result = browse_once(tool, f"{standin.base}/slow-hop?n=4&s=0.4")
    took = time.monotonic() - begun
    assert not result.ok and "took longer than 1 s" in result.text, result.text
    assert took < 1.8, took
