"""specedge is now draftproof: this package keeps the old import names working for one release.

`import specedge.cli`, `from specedge.cli.specrun import main`, `import specedge.models` (any
`specedge.X`) give the module `draftproof.X` itself: the same object, not a copy, so state and
monkeypatches are shared, and nothing runs twice. Importing `specedge` warns once
(DeprecationWarning, pointed at the importing line). `python -m specedge.cli.specrun` runs
draftproof's code too, with a warning on stderr. The next release removes this package (and
"specedge" from pyproject's packages).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

NEW = "draftproof"
MESSAGE = ("specedge is now draftproof: import draftproof.cli / draftproof.models; specedge goes "
           "away in the next release")


def _renamed(fullname: str) -> str:
    return NEW + fullname[len(__name__):]


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`specedge.X` is `draftproof.X`. It stands first on sys.meta_path, so that an older
    installation's finder (an editable install of specedge maps specedge.cli to a checkout)
    never loads a second copy."""

    def __init__(self):
        self._specs = {}  # alias name -> the draftproof module's own spec, while it loads

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        real = importlib.util.find_spec(_renamed(fullname))  # imports its parents
        if real is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, self, origin=real.origin,  # origin: __file__ under python -m
            is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(_renamed(spec.name))
        # the import system then sets __spec__ on whatever create_module returns: keep the
        # module's own, to put back in exec_module
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # nothing to run (it ran as draftproof.X); module.__spec__ is the alias's here
        module.__spec__ = self._specs.pop(module.__spec__.name)

    def get_code(self, fullname):
        """For `python -m specedge.cli.specrun`: draftproof's code, run as __main__ (a command
        line: the warning goes to stderr, where DeprecationWarning's default filter would hide
        it)."""
        real = _renamed(fullname)
        print(f"warning: python -m {fullname} is deprecated: specedge is now draftproof; run "
              f"python -m {real} (specedge goes away in the next release)", file=sys.stderr)
        return importlib.util.find_spec(real).loader.get_code(real)


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())

warnings.warn(MESSAGE, DeprecationWarning, stacklevel=2)
