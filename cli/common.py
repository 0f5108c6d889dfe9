"""What both command-line tools share: bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import functools
import logging
import shlex
import signal
import sys
import threading
import time

import click

from spec_runtime.errors import InputError


class BadInput(click.ClickException):
    """Exit code 2 with the message on one line."""

    exit_code = 2


class BundleCommand(click.Command):
    """A command that takes its bundle as -b/--bundle: a bare path (how `specrun check` and
    `specexport verify/engine` took it before) is answered with the option to use instead of
    click's "unexpected extra argument"."""

    def __init__(self, *args, **kwargs):
        kwargs["context_settings"] = {**(kwargs.get("context_settings") or {}),
                                      "allow_extra_args": True}
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx, args):
        rest = super().parse_args(ctx, args)
        if ctx.args:
            command = f"{ctx.find_root().info_name} {ctx.info_name}"
            raise click.UsageError(f"unexpected argument {ctx.args[0]!r}: give the bundle as "
                                   f"-b/--bundle, e.g. `{command} --bundle "
                                   f"{shlex.quote(ctx.args[0])}`", ctx)
        return rest


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that `finally` blocks (temporary directories) run."""

    signum = signal.SIGTERM


def input_errors(fn):
    """Turn the library's InputErrors (bad values, bundles, models, capacity) into exit code 2
    with the library's own message; anything else is a bug and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InputError as e:
            raise BadInput(str(e)) from None
        except KeyboardInterrupt as e:
            click.echo("interrupted", err=True)
            sys.exit(128 + getattr(e, "signum", signal.SIGINT))

    return wrapper


@contextlib.contextmanager
def sigterm_as_interrupt(on_signal=None):
    """While a command runs, SIGTERM unwinds the stack like Ctrl-C instead of killing the
    process on the spot, and both call `on_signal(exc)` first, so that a library that swallows
    the KeyboardInterrupt (torch's exporter may, mid-trace) can still be stopped at its next
    checkpoint. For CLI entry points only: the library installs no signal handlers. The previous
    handlers are restored afterwards (the command may run inside a host process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        exc = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        if on_signal is not None:
            on_signal(exc)
        raise exc

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def library_messages(name: str, prefix: str):
    """While a command runs, the library's warnings (logger `name`) reach stderr as lines
    `prefix: message`; the library itself never prints."""
    logger = logging.getLogger(name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


class Progress:
    """A progress bar on a terminal, a line per step elsewhere (a log, CI), with the time spent
    and, until the end, the time left at the rate so far. `clock` is injectable."""

    def __init__(self, total: int, label: str, clock=time.monotonic):
        self.total, self.label, self.done, self.clock = total, label, 0, clock
        self.t0 = clock()
        self.bar = None
        if sys.stderr.isatty():
            self.bar = click.progressbar(length=total, label=label, file=sys.stderr)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, n: int = 1):
        step = max(1, self.total // 10)  # about ten lines when it is not a terminal
        before, self.done = self.done, self.done + n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done // step > before // step or self.done == self.total:
            spent = self.clock() - self.t0
            left = spent * (self.total - self.done) / self.done if self.done else 0.0
            click.echo(f"{self.label}: {self.done}/{self.total} ({duration(spent)}"
                       + (f", about {duration(left)} left" if self.done < self.total else "")
                       + ")", err=True)


def duration(seconds: float) -> str:
    """12 s, 4 min 05 s."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"
