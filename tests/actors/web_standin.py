"""A local stand-in for a Serper-compatible search API and for hostile web pages, on 127.0.0.1.

POST /search answers in Serper's JSON (`searchParameters`, `organic: [{title, link, snippet,
position}]`, optionally `answerBox`) when the `X-API-KEY` header holds KEY (401 otherwise);
`fail_next` makes the next N searches answer 503. GET serves the pages below (`hits` counts
the requests for each).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter

from aiohttp import web

KEY = "test-key-5f2c9e"  # a key only this stand-in knows: it must never be written anywhere


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebStandIn:
    def __init__(self) -> None:
        self.port = free_port()
        self.searches: list[dict] = []
        self.hits: Counter = Counter()
        self.fail_next = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def search(self, request: web.Request) -> web.Response:
        if request.headers.get("X-API-KEY") != KEY:
            return web.json_response({"message": "Unauthorized."}, status=401)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=503)
        body = await request.json()
        self.searches.append(body)
        q = body["q"]
        organic = [
            {
                "title": f"{q} - result {i}",
                "link": f"{self.base}/page.html?r={i}",
                "snippet": f"Snippet {i} about {q}.",
                "position": i,
            }
            for i in range(1, body.get("num", 10) + 1)
        ]
        return web.json_response(
            {
                "searchParameters": {"q": q, "type": "search", "engine": "google"},
                "answerBox": {"title": "Answer", "answer": f"The answer to {q}"},
                "organic": organic,
                "credits": 1,
            }
        )

    async def page(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] += 1
        if name == "page.html":
            html = (
                "<html><head><title>T</title><style>p{}</style></head><body>"
                "<script>var secret = 1;</script><h1>Varno Telik</h1><p>Born in Quorvex.</p>"
                "</body></html>"
            )
            return web.Response(text=html, content_type="text/html")
        if name == "huge":
            response = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await response.prepare(request)
            for _ in range(200):  # 200 x 64 KiB = 12.5 MiB if read to the end
                try:
                    await response.write(b"a" * 65536)
                except (ConnectionResetError, RuntimeError):
                    break
            return response
        if name == "binary":
            return web.Response(body=b"\x89PNG\r\n\x1a\n\x00\x00" * 50, content_type="image/png")
        if name == "unlabelled-binary":
            return web.Response(body=b"abc\x00\x01\x02" * 50, content_type="text/plain")
        if name == "latin1":
            return web.Response(
                body="Café Müller".encode("latin-1"),
                headers={"Content-Type": "text/plain; charset=iso-8859-1"},
            )
        if name == "not-utf8":
            return web.Response(body=b"caf\xe9 \xff\xfe ok", headers={"Content-Type": "text/plain"})
        if name == "to-localhost":  # the same server, by a name the allow-list does not hold
            raise web.HTTPFound(f"http://localhost:{self.port}/page.html")
        if name == "to-private":
            raise web.HTTPFound("http://10.0.0.1/admin")
        if name == "to-metadata":
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")
        if name == "to-page":
            raise web.HTTPFound("/page.html")
        if name == "to":  # a redirect to wherever ?url= says
            raise web.HTTPFound(request.query["url"])
        if name == "slow-hop":  # ?n=N: N redirects, each answered after ?s= seconds, then the page
            n = int(request.query["n"])
            await asyncio.sleep(float(request.query["s"]))
            target = "/page.html" if n == 0 else f"/slow-hop?n={n - 1}&s={request.query['s']}"
            raise web.HTTPFound(target)
        if name == "loop":
            raise web.HTTPFound("/loop")
        raise web.HTTPNotFound()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/search", self.search)
        app.router.add_get("/{name}", self.page)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> WebStandIn:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
