"""`specrun serve` without Ray: the app under uvicorn until SIGTERM or SIGINT, then the drain
(server.Server.begin_drain: requests in flight finish, new ones get 503), and a clean exit."""

import asyncio
import contextlib
import errno
import logging
import socket
import threading

from ..errors import FieldError, InputError
from .server import DRAIN_SECONDS
from .slots import DECODE_THREAD

log = logging.getLogger(__name__)

BACKLOG = 2048  # uvicorn's


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to `host`:`port` now, as uvicorn would bind them (asyncio's create_server:
    every address the host names, SO_REUSEADDR, IPv6 sockets IPv6 only), so that an address
    that cannot be used is an InputError naming it before the bundle loads, instead of
    uvicorn's log lines and exit code. They listen only when serving starts (`listen`), as
    vLLM's early-bound socket does: until the app is ready, a client is refused, not kept
    waiting."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:  # (UnicodeError: a label IDNA cannot encode)
        raise FieldError("host", f"host={host!r} is neither an IP address nor a name this machine "
                         f"resolves ({e}): use one of its addresses, 127.0.0.1 (this machine "
                         f"only) or 0.0.0.0 (every interface)") from None
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # an address family this system lacks (IPv6 off): as asyncio does
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as e:
        close(sockets)
        raise address_refusal(host, port, e) from None
    if not sockets:
        raise FieldError("host", f"host={host!r} names no address this system can listen on: "
                                 f"use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    return sockets


def listen(sockets: list[socket.socket], host: str, port: int) -> None:
    """Start listening on bound sockets; InputError if another server took the port since
    (SO_REUSEADDR lets a second socket bind a port nobody listens on yet)."""
    try:
        for sock in sockets:
            sock.listen(BACKLOG)
    except OSError as e:
        close(sockets)
        raise address_refusal(host, port, e) from None


def close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def address_refusal(host: str, port: int, e: OSError) -> InputError:
    """Why `host`:`port` cannot be listened on, in words naming the value and the fix."""
    if e.errno == errno.EADDRINUSE:
        return FieldError("port", f"port={port} is in use on {host or 'every interface'}: stop "
                                  f"what uses it or choose another port (0: any free port)")
    if e.errno == errno.EADDRNOTAVAIL:
        return FieldError("host", f"host={host!r} is not an address of this machine: use one of "
                                  f"its addresses, 127.0.0.1 (this machine only) or 0.0.0.0 "
                                  f"(every interface)")
    if e.errno == errno.EACCES and 0 < port < 1024:
        return FieldError("port", f"port={port} is a privileged port, which this user may not "
                                  f"listen on: choose one from 1024 up (0: any free port), or run "
                                  f"as a user that may")
    return InputError(f"cannot listen on {host}:{port} ({e.strerror}): choose another host or "
                      f"port")


def run_uvicorn(app, host: str = "127.0.0.1", port: int = 8000, *,
                drain_seconds: float = DRAIN_SECONDS, log_level: str = "info",
                on_ready=None, sockets: list[socket.socket] | None = None) -> None:
    """Serve `app` with uvicorn until SIGTERM or SIGINT, then drain (create_app's
    begin_drain) and return normally: a clean shutdown is exit code 0. A second signal exits
    at once. `sockets`: bind_sockets(host, port) made before the app was (so that a bad
    address cost no load); without them they are made here. An address that cannot be used is
    an InputError."""
    import signal

    if sockets is None:
        sockets = bind_sockets(host, port)
    listen(sockets, host, port)

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # ours below: drain first, and no re-raised signal after
            yield

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and self.started:
                on_ready(self)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_seconds + 5, access_log=False)
    server = Server(config)

    async def main():
        loop = asyncio.get_running_loop()

        signals = 0

        def stop():
            nonlocal signals
            signals += 1
            if signals == 1:
                log.warning("shutting down: finishing the requests in flight (at most %.0f s)",
                            drain_seconds)
                begin = getattr(app.state, "begin_drain", None)
                if begin is not None:
                    begin()
                server.should_exit = True
            elif signals == 2:  # cut the drain short: every request ends now, with its error
                log.warning("shutting down now: cancelling the requests in flight")
                end = getattr(app.state, "end_drain", None)
                if end is not None:
                    end()
            else:
                server.force_exit = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        await server.serve(sockets=sockets)

    asyncio.run(main())
    # a decode thread still inside ONNX Runtime when the interpreter exits would abort it
    for thread in threading.enumerate():
        if thread.name == DECODE_THREAD:
            thread.join(timeout=drain_seconds)
