"""The HTTP plumbing under the server's routes: the gate every request passes before its
route, the body reader with its size limit, watching for a client that has gone, and the
streamed response that gives its request up however it ends."""

import asyncio
import functools
import json
from typing import Any

from .openai_api import APIError

MAX_BODY_BYTES = 1 << 20  # a request body; a prompt of the largest cache is a few tens of KB
CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent to anyone
POLL_S = 0.1  # how often a waiting or decoding request looks for its client's disconnect


def client_gone() -> APIError:
    return APIError(CLIENT_GONE, "the client closed the connection", code="client_closed")


async def disconnected(request) -> None:
    """Return when the client of `request` has gone (its body already read)."""
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)


class Gate:
    """Checks every HTTP request before its route (`check(scope)` answers it, or lets it
    through with None), as plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide
    the client's disconnect from the route (request.is_disconnected() never turns true behind
    it), and a request whose client left would hold its slot to the end."""

    def __init__(self, app, check):
        self.app, self.check = app, check

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            response = self.check(scope)
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def body_chunks(request, limit: int, too_large: str):
    """The request's body as it arrives (a chunked one too), each route's one reader: a 413
    saying `too_large` once it passes `limit` bytes, the client gone (client_gone) when it
    disconnects."""
    from starlette.requests import ClientDisconnect

    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, too_large, code="request_too_large")
            yield chunk
    except ClientDisconnect:
        raise client_gone() from None


async def read_json(request) -> Any:
    body = bytearray()
    async for chunk in body_chunks(request, MAX_BODY_BYTES,
                                   f"the request body exceeds {MAX_BODY_BYTES} bytes"):
        body += chunk
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests its values too deeply to be a request",
                       code="invalid_json") from None


@functools.cache
def _streamed_class():
    from fastapi.responses import StreamingResponse
    from starlette.requests import ClientDisconnect

    class Streamed(StreamingResponse):
        """Server-sent events whose request is given up however the response ends: Starlette
        never starts the body when the client is gone before the first byte (an ASGI 2.4
        server's send raises), and a body never started runs no `finally` of its own."""

        def __init__(self, body, on_close):
            super().__init__(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            except ClientDisconnect:  # nobody to answer: on_close counts it (499), no bug
                pass
            finally:
                try:
                    await self.body_iterator.aclose()  # a started body's own finally, now
                finally:
                    self.on_close()

    return Streamed


def streamed_response(body, on_close):
    return _streamed_class()(body, on_close)
