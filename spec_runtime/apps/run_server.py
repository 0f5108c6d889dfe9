"""`specrun serve` without Ray: the app under uvicorn until SIGTERM or SIGINT, then the drain
(server.Server.begin_drain: requests in flight finish, new ones get 503), and a clean exit."""

import asyncio
import contextlib
import logging
import threading

from .server import DRAIN_SECONDS
from .slots import DECODE_THREAD

log = logging.getLogger(__name__)


def run_uvicorn(app, host: str = "127.0.0.1", port: int = 8000, *,
                drain_seconds: float = DRAIN_SECONDS, log_level: str = "info",
                on_ready=None) -> None:
    """Serve `app` with uvicorn until SIGTERM or SIGINT, then drain (create_app's
    begin_drain) and return normally: a clean shutdown is exit code 0. A second signal exits
    at once."""
    import signal

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
        await server.serve()

    asyncio.run(main())
    # a decode thread still inside ONNX Runtime when the interpreter exits would abort it
    for thread in threading.enumerate():
        if thread.name == DECODE_THREAD:
            thread.join(timeout=drain_seconds)
