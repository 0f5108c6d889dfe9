"""The errors specedge raises for what its user can fix.

`InputError` and its subclasses are bad input: a value, a file, a bundle, a model. Each message
names the value and the fix. The command-line tools turn exactly these into one line on stderr
and exit code 2; any other exception is a bug in specedge and keeps its traceback. They derive
from ValueError, so code that catches ValueError keeps working.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input; the message names the value and the fix."""


class BuildError(InputError):
    """Bad input to `specexport build` (a model, a source, an option, the output directory)."""


class BundleError(InputError):
    """A bundle that cannot be used (missing, damaged, edited, unreadable)."""


class CacheCapacityError(InputError):
    """A request needs more positions than the static KV cache holds."""


class NonFiniteLogitsError(InputError):
    """The graph produced NaN or +inf logits: no token may be drawn from such a distribution
    (a corrupt graph or corrupt inputs)."""


class TemplateError(InputError):
    """The chat template refused the messages (its own raise_exception)."""


def install_extra(extra: str) -> str:
    """The command that installs one of specedge's extras here: from a checkout (the package's
    directory sits beside its pyproject.toml, as an editable install leaves it) `pip install -e
    "CHECKOUT[extra]"`, else `pip install "specedge[extra]"`."""
    from pathlib import Path

    checkout = Path(__file__).resolve().parents[1]
    project = checkout / "pyproject.toml"
    try:
        ours = 'name = "specedge"' in project.read_text(encoding="utf-8")
    except OSError:
        ours = False
    if ours:
        return f'pip install -e "{checkout}[{extra}]"'
    return f'pip install "specedge[{extra}]"'
