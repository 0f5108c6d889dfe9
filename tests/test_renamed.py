"""specedge is now draftproof. For one release the import names keep working, with a warning
said once (as the very modules of the new ones; checked in a fresh interpreter, since imports and
their warning happen once per process); nothing else of the old name is read."""

import json
import os
import subprocess
import sys
from pathlib import Path

from spec_runtime.bundle.reader import default_bundle_dir

ROOT = Path(__file__).resolve().parents[1]

SHIM_CHECK = r"""
import json, sys, warnings

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import specedge.cli
    import specedge.cli.specrun
    from specedge.cli.specrun import main
    from specedge.cli.specexport import main as export_main
    import specedge.models
    from specedge.models import for_hf_model
    import specedge  # again: no second warning

import draftproof.cli
import draftproof.cli.specexport
import draftproof.cli.specrun
import draftproof.models

deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
print(json.dumps({
    "warnings": [str(w.message) for w in deprecations],
    "warned_at": [w.filename for w in deprecations],
    "same": [specedge.cli is draftproof.cli, specedge.models is draftproof.models,
             specedge.cli.specrun is draftproof.cli.specrun,
             sys.modules["specedge.cli.specrun"] is draftproof.cli.specrun,
             main is draftproof.cli.specrun.main,
             export_main is draftproof.cli.specexport.main,
             for_hf_model is draftproof.models.for_hf_model],
    "specs": [draftproof.cli.__spec__.name, draftproof.cli.specrun.__spec__.name,
              draftproof.models.__spec__.name],
    "specrun_modules": len({id(m) for n, m in sys.modules.items()
                            if n.endswith("cli.specrun")}),
}))
"""


def _python(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ), timeout=300, **kwargs)


def test_specedge_imports_are_draftproof_modules_with_one_deprecation_warning():
    r = _python("-c", SHIM_CHECK)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["warnings"] == ["specedge is now draftproof: import draftproof.cli / "
                               "draftproof.models; specedge goes away in the next release"]
    assert out["warned_at"] == ["<string>"]  # the importing line, not importlib's
    assert all(out["same"]), out["same"]
    # the draftproof modules keep their own spec (python -m, reload) and are loaded once
    assert out["specs"] == ["draftproof.cli", "draftproof.cli.specrun", "draftproof.models"]
    assert out["specrun_modules"] == 1


def test_python_m_with_the_old_name_runs_the_new_module():
    new = _python("-m", "draftproof.cli.specrun", "--version")
    old = _python("-m", "specedge.cli.specrun", "--version")
    assert new.returncode == old.returncode == 0, new.stderr + old.stderr
    assert new.stdout.split()[-1] == old.stdout.split()[-1]
    assert "python -m specedge.cli.specrun is deprecated" in old.stderr
    assert "python -m draftproof.cli.specrun" in old.stderr
    assert "specedge" not in new.stderr


def test_an_unknown_old_name_is_not_found_under_it():
    r = _python("-W", "ignore::DeprecationWarning", "-c", "import specedge.nothing")
    assert r.returncode == 1 and "No module named 'specedge.nothing'" in r.stderr, r.stderr


# --- one name: what a user set up for specedge is not read -----------------------------------

def test_the_old_names_variables_and_directories_are_not_read(monkeypatch, tmp_path):
    """Only the import names keep working: $SPECEDGE_BUNDLE and specedge's data directory
    no longer stand in for draftproof's."""
    monkeypatch.delenv("DRAFTPROOF_BUNDLE", raising=False)
    monkeypatch.setenv("SPECEDGE_BUNDLE", str(tmp_path / "old-bundle"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    (tmp_path / "data" / "specedge" / "default").mkdir(parents=True)
    assert default_bundle_dir() == tmp_path / "data" / "draftproof" / "default"
