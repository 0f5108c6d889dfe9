"""What both command-line tools share: bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import functools
import sys

import click


class InputError(click.ClickException):
    exit_code = 2


def input_errors(fn):
    """Turn the library's ValueErrors (bad values, bad bundles, capacity) into exit code 2 with
    the library's own message; anything else is a bug and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise InputError(str(e)) from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper
