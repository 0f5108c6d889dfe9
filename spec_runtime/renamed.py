"""specedge is now draftproof. What a user set up under the old name keeps working for one release,
each use with a warning that names the new name, said once per process; nothing is moved or
deleted. The next release removes these fallbacks (and this module):

    $SPECEDGE_BUNDLE, $SPECEDGE_API_KEY, ...    read when $DRAFTPROOF_... is unset (or empty)
    $XDG_DATA_HOME/specedge/default             specedge's default bundle, used while
      (~/.local/share/specedge/default)           draftproof's does not exist (bundle/reader.py);
                                                  `specexport build` writes draftproof's

The warnings are RenamedWarning, a DeprecationWarning; the command-line tools print them as
lines on stderr (cli/common.py). Kept as `specedge` on purpose, because bundles, clients and
dashboards already depend on them: the ONNX graph metadata keys (`specedge.role`...) and the
manifest's format names (bundle/contract.py, bundle/manifest.py, spec_export/output.py), the
OpenAI responses' `specedge` field (sent beside `draftproof`, apps/openai_api.py) and the
Prometheus metric names (apps/metrics.py).
"""

from __future__ import annotations

import os
import warnings

OLD, NEW = "specedge", "draftproof"
OLD_ENV, NEW_ENV = "SPECEDGE_", "DRAFTPROOF_"


class RenamedWarning(DeprecationWarning):
    """A name from before specedge became draftproof was used; the message names the new one."""


_said: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """Warn `message` (RenamedWarning) the first time this process says it, never again."""
    if message in _said:
        return
    _said.add(message)
    warnings.warn(message, RenamedWarning, stacklevel=stacklevel + 1)


def old_variable(name: str) -> str:
    """$SPECEDGE_X for $DRAFTPROOF_X."""
    if not name.startswith(NEW_ENV):
        raise ValueError(f"{name} is not a {NEW_ENV}* variable")
    return OLD_ENV + name[len(NEW_ENV):]


def getenv(name: str) -> tuple[str, str | None]:
    """(the variable read, its value) for $DRAFTPROOF_X: its own value if set and not empty,
    else $SPECEDGE_X's (with a warning), else (name, None)."""
    value = os.environ.get(name)
    if value:
        return name, value
    old = old_variable(name)
    value = os.environ.get(old)
    if value:
        warn_once(f"${old} is deprecated: specedge is now draftproof, set ${name} instead "
                  f"(${old} is read while ${name} is unset, until the next release)",
                  stacklevel=2)
        return old, value
    return name, None


def show_warnings() -> None:
    """For scripts (the benchmarks): show RenamedWarnings, which DeprecationWarning's default
    filter hides outside __main__. The command-line tools print them their own way."""
    warnings.simplefilter("default", RenamedWarning)
