"""The `browse` tool: a web page's text, cut to the observation budget.

Hostile pages are normal input. Only http(s) URLs are fetched; every hop of a redirect (at most
MAX_REDIRECTS) is checked before it is followed, and an address that resolves to a loopback,
private, link-local, reserved or multicast address is refused, unless its `host:port` is in
`allow_hosts` (an explicit entry: the tests' stand-in on 127.0.0.1); the connection's own name
lookup refuses the same (`GuardedResolver`: no DNS rebinding). At most `max_bytes` are
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

from actors.tools import ToolResult, trajectory
from actors.web_search import WebStats

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


def _blocked(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_reserved
        or ip.is_multicast
        or ip.is_unspecified
    )


async def check_address(url: str, allow_hosts: frozenset[str]) -> None:
    """Raise PageError unless `url` is http(s) and its host resolves only to public addresses
    (or its `host:port` is allowed)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PageError(f"only http and https URLs can be browsed, not {url[:200]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise PageError(f"bad port in {url[:200]!r}") from None
    if f"{parts.hostname}:{port}" in allow_hosts:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port)
    except (socket.gaierror, UnicodeError) as exc:
        raise PageError(f"cannot resolve {parts.hostname} ({exc})") from None
    addresses = {info[4][0] for info in infos}
    if not addresses or any(_blocked(a) for a in addresses):
        raise PageError(f"{parts.hostname} is a loopback, private or reserved address: not browsed")


class GuardedResolver(AbstractResolver):
    """The connection's own name lookup, refusing what `check_address` refuses: a name that
    resolved to a public address when checked and to a private one when connected (DNS
    rebinding) is not reached either."""

    def __init__(self, allow_hosts: frozenset[str]) -> None:
        self.allow_hosts = allow_hosts
        self.inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        if f"{host}:{port}" not in self.allow_hosts and any(_blocked(r["host"]) for r in found):
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


class BrowseTool:
    """`browse`: the text of the page at a URL (see the module doc)."""

    name = "browse"
    call_tag = "browse"
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
    ) -> None:
        self.max_bytes, self.max_chars = max_bytes, max_chars
        self.max_calls_per_trajectory = max_calls_per_trajectory
        self.timeout_s = timeout_s
        self.allow_hosts = frozenset(allow_hosts)
        self.stats = stats or WebStats()
        self.session: aiohttp.ClientSession | None = None
        self.session_loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, argument: str) -> ToolResult:
        url = argument.strip()
        calls = trajectory().calls
        if calls[self.name] >= self.max_calls_per_trajectory:
            self.stats.outcomes["browse_refused_trajectory_budget"] += 1
            return ToolResult(
                False,
                f"Browse refused: this answer has read its {self.max_calls_per_trajectory} pages.",
            )
        calls[self.name] += 1
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
            connector = aiohttp.TCPConnector(resolver=GuardedResolver(self.allow_hosts))
            self.session = aiohttp.ClientSession(connector=connector)
            self.session_loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            for _ in range(MAX_REDIRECTS + 1):
                await check_address(url, self.allow_hosts)
                async with self.session.get(
                    url, allow_redirects=False, timeout=timeout
                ) as response:
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
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PageError(f"{type(exc).__name__}" + (f" ({exc})" if str(exc) else "")) from None
        raise PageError(f"more than {MAX_REDIRECTS} redirects")

    async def close(self) -> None:
        if self.session is not None and self.session_loop is asyncio.get_running_loop():
            await self.session.close()
        self.session = None
