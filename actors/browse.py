"""The `browse` tool: a web page's text, cut to the observation budget.

Hostile pages are normal input. Only http(s) URLs are fetched, and only from globally routable
addresses (`is_public`): every special-purpose range of IANA's IPv4 and IPv6 registries is
refused (loopback, private, shared/CGNAT with its cloud metadata services, link-local,
documentation, benchmarking, multicast, ...), and an IPv6 address that carries an IPv4 one
(mapped, NAT64, 6to4, Teredo, IPv4-compatible) is judged by that one too, unless its
`host:port` is in `allow_hosts` (an explicit entry: the tests' stand-in on 127.0.0.1). Every hop
of a redirect (at most MAX_REDIRECTS) is checked before it is followed, and the connection's own
name lookup refuses the same (`GuardedResolver`: no DNS rebinding). The whole fetch (name
lookups, every hop, reading the page) has one deadline, `timeout_s`. At most `max_bytes` are
read; a page that is not text (by its content type, or NUL bytes in it) is refused; text is
decoded by its declared charset, else UTF-8, undecodable bytes replaced; HTML is reduced to its
visible text. A failure is an observation, never an exception into the agent loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from actors.tools import FunctionTool, ToolResult
from actors.web_search import TrajectoryCalls, WebStats

MAX_REDIRECTS = 5
TEXT_TYPES = ("text/", "application/xhtml", "application/json", "application/xml")
_SKIP = {"script", "style", "noscript", "template", "svg", "head"}


class PageError(Exception):
    """A page that is not read: the observation's text."""


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in _SKIP:
            self.skipping += 1

    def handle_endtag(self, tag) -> None:
        if tag in _SKIP and self.skipping:
            self.skipping -= 1

    def handle_data(self, data) -> None:
        if not self.skipping and data.strip():
            self.parts.append(" ".join(data.split()))


def html_text(html: str) -> str:
    """The visible text of an HTML document, one line per text node."""
    parser = _Text()
    parser.feed(html)
    parser.close()
    return "\n".join(parser.parts)


# Not globally reachable (IANA's special-purpose registries, multicast, the reserved 240/4 and
# 255.255.255.255). Where IANA calls a few addresses inside these global (192.0.0.9 and .10,
# anycast relays and AS112 in 2001::/23), they are refused with their range: no web page is there.
_V4_SPECIAL = tuple(
    ipaddress.IPv4Network(n)
    for n in [
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
    ]
)
_V6_UNICAST = ipaddress.IPv6Network("2000::/3")  # the only global unicast space; what is
# outside it (::1, mapped, fc00::/7, fe80::/10, ff00::/8, 100::/64, 5f00::/16, ...) is not
_V6_SPECIAL = tuple(
    ipaddress.IPv6Network(n) for n in ("2001::/23", "2001:db8::/32", "2002::/16", "3fff::/20")
)
_IPV4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: globally reachable
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries: mapped, NAT64, 6to4, Teredo (server and
    client), IPv4-compatible."""
    low = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _IPV4_MAPPED or ip in _NAT64 or ip in _IPV4_COMPATIBLE:
        return [low]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip.teredo is not None:
        return list(ip.teredo)
    return []


def _public_v4(ip: ipaddress.IPv4Address) -> bool:
    return ip.is_global and not any(ip in net for net in _V4_SPECIAL)


def is_public(address: str) -> bool:
    """Whether `address` is globally routable, so browse may reach it (a scope id is ignored;
    what does not parse is not). An IPv4-mapped or NAT64 address is its IPv4 address; any other
    IPv6 form that carries one must be a global unicast address and carry a public one."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return _public_v4(ip)
    embedded = embedded_ipv4(ip)
    if ip in _IPV4_MAPPED or ip in _NAT64:
        return _public_v4(embedded[0])
    return (
        ip.is_global
        and ip in _V6_UNICAST
        and not any(ip in net for net in _V6_SPECIAL)
        and all(_public_v4(v4) for v4 in embedded)
    )


async def check_address(
    url: str, allow_hosts: frozenset[str], resolver: AbstractResolver | None = None
) -> None:
    """Raise PageError unless `url` is http(s) and its host is, or resolves (through `resolver`,
    else the system's) only to, public addresses, or its `host:port` is allowed."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PageError(f"only http and https URLs can be browsed, not {url[:200]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise PageError(f"bad port in {url[:200]!r}") from None
    host = parts.hostname
    if f"{host}:{port}" in allow_hosts:
        return
    try:
        ipaddress.ip_address(host.split("%")[0])
        addresses = {host}  # a literal: connected to as written, no lookup
    except ValueError:
        resolver = resolver or ThreadedResolver()
        try:
            found = await resolver.resolve(host, port, socket.AF_UNSPEC)
        except (OSError, UnicodeError, ValueError) as exc:
            raise PageError(f"cannot resolve {host} ({exc})") from None
        addresses = {r["host"] for r in found}
    if not addresses or not all(is_public(a) for a in addresses):
        raise PageError(f"{host} is a loopback, private or reserved address: not browsed")


class GuardedResolver(AbstractResolver):
    """The connection's own name lookup, refusing what `check_address` refuses: a name that
    resolved to a public address when checked and to a private one when connected (DNS
    rebinding) is not reached either. `inner` does the lookup (the system's by default)."""

    def __init__(self, allow_hosts: frozenset[str], inner: AbstractResolver | None = None) -> None:
        self.allow_hosts = allow_hosts
        self.inner = inner or ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        if f"{host}:{port}" not in self.allow_hosts and not all(
            is_public(r["host"]) for r in found
        ):
            raise OSError(f"{host} resolved to a loopback, private or reserved address")
        return found

    async def close(self) -> None:
        await self.inner.close()


def decode(body: bytes, content_type: str, charset: str | None) -> str:
    """The page's text, or PageError when it is not text."""
    kind = content_type.split(";")[0].strip().lower()
    if kind and not kind.startswith(TEXT_TYPES):
        raise PageError(f"not a text page ({kind})")
    if b"\x00" in body[:4096]:
        raise PageError("not a text page (binary content)")
    try:
        text = body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        text = body.decode("utf-8", errors="replace")
    return html_text(text) if "html" in kind or re.search(r"(?i)<html|<body", text[:2048]) else text


class BrowseTool(FunctionTool, method="browse"):
    """`browse`: the text of the page at a URL (see the module doc); a trajectory reads at most
    `max_calls_per_trajectory` pages (its state: `TrajectoryCalls`)."""

    open_tag, close_tag = "<page>", "</page>"

    def __init__(
        self,
        *,
        max_bytes: int,
        max_chars: int,
        max_calls_per_trajectory: int,
        timeout_s: float,
        allow_hosts: tuple[str, ...] = (),
        stats: WebStats | None = None,
        resolver: AbstractResolver | None = None,
    ) -> None:
        """`resolver`: how names are looked up, for the check and the connection alike (the
        system's by default; the tests answer names themselves)."""
        self.max_bytes, self.max_chars = max_bytes, max_chars
        self.max_calls_per_trajectory = max_calls_per_trajectory
        self.timeout_s = timeout_s
        self.allow_hosts = frozenset(allow_hosts)
        self.stats = stats or WebStats()
        self.resolver = resolver
        self.lookup: AbstractResolver | None = None  # the resolver of the current session
        self.session: aiohttp.ClientSession | None = None
        self.session_loop: asyncio.AbstractEventLoop | None = None

    async def create(self) -> TrajectoryCalls:
        return TrajectoryCalls()

    async def release(self, calls: TrajectoryCalls) -> None:
        """Nothing to give back: the count ends with its trajectory."""

    async def browse(self, calls: TrajectoryCalls, url: str) -> ToolResult:
        """Read a web page; returns its text, cut to a budget.

        Args:
            url: The page's URL.
        """
        url = url.strip()
        if calls.made >= self.max_calls_per_trajectory:
            self.stats.outcomes["browse_refused_trajectory_budget"] += 1
            return ToolResult(
                False,
                f"Browse refused: this answer has read its {self.max_calls_per_trajectory} pages.",
            )
        calls.made += 1
        try:
            text = await self._read(url)
        except PageError as exc:
            self.stats.outcomes["browse_failed"] += 1
            return ToolResult(False, f"Browse failed: {exc}")
        self.stats.outcomes["browse_read"] += 1
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + f"\n[... page cut at {self.max_chars} characters]"
        return ToolResult(True, text or "(the page has no text)")

    async def _read(self, url: str) -> str:
        if self.session is None or self.session_loop is not asyncio.get_running_loop():
            # a session belongs to its event loop: an evaluation after a run, a test's next
            # asyncio.run, gets its own
            self.lookup = self.resolver or ThreadedResolver()
            guarded = GuardedResolver(self.allow_hosts, self.lookup)
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=guarded))
            self.session_loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):  # one deadline for every lookup and hop
                return await self._follow(self.session, url)
        except TimeoutError:
            raise PageError(
                f"the page took longer than {self.timeout_s:g} s "
                "(name lookups, redirects and reading together)"
            ) from None

    async def _follow(self, session: aiohttp.ClientSession, url: str) -> str:
        no_limit = aiohttp.ClientTimeout(total=None)  # the deadline around this is the limit
        try:
            for _ in range(MAX_REDIRECTS + 1):
                await check_address(url, self.allow_hosts, self.lookup)
                async with session.get(url, allow_redirects=False, timeout=no_limit) as response:
                    if response.status in (301, 302, 303, 307, 308):
                        target = response.headers.get("Location")
                        if not target:
                            raise PageError(f"HTTP {response.status} without a Location")
                        url = urljoin(url, target)
                        continue
                    if response.status != 200:
                        raise PageError(f"HTTP {response.status}")
                    chunks, size = [], 0
                    async for chunk in response.content.iter_chunked(1 << 16):
                        chunks.append(chunk)
                        size += len(chunk)
                        if size >= self.max_bytes:  # a huge page: its first max_bytes only
                            break
                    body = b"".join(chunks)[: self.max_bytes]
                    kind = response.headers.get("Content-Type", "")
                    return decode(body, kind, response.charset)
        except aiohttp.ClientError as exc:
            raise PageError(f"{type(exc).__name__}" + (f" ({exc})" if str(exc) else "")) from None
        raise PageError(f"more than {MAX_REDIRECTS} redirects")

    async def close(self) -> None:
        if self.session is not None and self.session_loop is asyncio.get_running_loop():
            await self.session.close()
        self.session = None
