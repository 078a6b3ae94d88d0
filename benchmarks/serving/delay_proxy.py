"""An HTTP proxy that holds every ``POST /generate`` for ``--delay-s`` before passing it on.

Put between ``sglang_router --pd-disaggregation`` and the decode server, it makes decode's half of
each request arrive that much after prefill's (the router sends both at once): the case where the
PD relay lets prefill finish and free its KV without waiting for decode. Everything else (health,
server info, the streamed answer) passes through unchanged; it listens on 127.0.0.1.

    python -m kvconnect.benchmarks.serving.delay_proxy --port 31100 --target http://127.0.0.1:30001 --delay-s 2
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}


def make_app(target: str, delay_s: float) -> web.Application:
    session: dict = {}

    async def start(app):
        session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))

    async def stop(app):
        await session["s"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST" and request.path == "/generate" and delay_s > 0:
            await asyncio.sleep(delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with session["s"].request(request.method, target + request.path_qs, data=body,
                                        headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                 if k.lower() not in HOP})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application(client_max_size=256 << 20)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--target", required=True, help="the decode server's URL")
    p.add_argument("--delay-s", type=float, default=2.0)
    a = p.parse_args(argv)
    web.run_app(make_app(a.target.rstrip("/"), a.delay_s), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
