"""specedge is now draftproof. For one release the old names keep working, each with a warning
said once: the import names (as the very modules of the new ones; checked in a fresh interpreter,
since imports and their warning happen once per process), the environment variables
($SPECEDGE_X while $DRAFTPROOF_X is unset), the default bundle's directory (specedge's while
draftproof's is absent) and the benchmarks' model cache."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import run

from spec_runtime import renamed
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


# --- the names a user set up for specedge: environment variables, the data directory ----------

@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No warning said yet in this process, no variable of either name set, HOME and
    XDG_DATA_HOME in tmp_path."""
    monkeypatch.setattr(renamed, "_said", set())
    for name in list(os.environ):
        if name.startswith((renamed.OLD_ENV, renamed.NEW_ENV)):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path


def renamed_warnings(fn, *args, **kwargs):
    """fn's value and the RenamedWarnings it gave, every one recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn(*args, **kwargs)
    return value, [str(w.message) for w in caught if issubclass(w.category, renamed.RenamedWarning)]


def test_the_old_variable_is_read_with_a_warning_only_while_the_new_one_is_unset(fresh,
                                                                                 monkeypatch):
    old, new = fresh / "old-bundle", fresh / "new-bundle"
    monkeypatch.setenv("SPECEDGE_BUNDLE", str(old))
    with pytest.warns(DeprecationWarning, match=r"\$SPECEDGE_BUNDLE is deprecated: specedge is "
                      r"now draftproof, set \$DRAFTPROOF_BUNDLE instead"):
        assert default_bundle_dir() == old
    assert renamed_warnings(default_bundle_dir) == (old, [])  # said once
    assert renamed.getenv("DRAFTPROOF_BUNDLE") == ("SPECEDGE_BUNDLE", str(old))

    monkeypatch.setenv("DRAFTPROOF_BUNDLE", "")  # empty counts as unset, as before
    assert default_bundle_dir() == old

    monkeypatch.setattr(renamed, "_said", set())
    monkeypatch.setenv("DRAFTPROOF_BUNDLE", str(new))  # both set: the new one wins, silently
    assert renamed_warnings(default_bundle_dir) == (new, [])
    assert renamed.getenv("DRAFTPROOF_BUNDLE") == ("DRAFTPROOF_BUNDLE", str(new))

    monkeypatch.delenv("SPECEDGE_BUNDLE")
    assert renamed_warnings(default_bundle_dir) == (new, [])
    monkeypatch.delenv("DRAFTPROOF_BUNDLE")
    assert renamed.getenv("DRAFTPROOF_BUNDLE") == ("DRAFTPROOF_BUNDLE", None)


def test_the_cli_prints_the_warning_on_stderr_once(fresh, monkeypatch):
    from draftproof.cli.specrun import main as specrun

    monkeypatch.setenv("SPECEDGE_BUNDLE", str(fresh / "old-bundle"))
    r = run(specrun, "where")
    assert r.exit_code == 0 and r.stdout == f"{fresh / 'old-bundle'}\n", r.output
    assert r.stderr == ("specrun: warning: $SPECEDGE_BUNDLE is deprecated: specedge is now "
                        "draftproof, set $DRAFTPROOF_BUNDLE instead ($SPECEDGE_BUNDLE is read "
                        "while $DRAFTPROOF_BUNDLE is unset, until the next release)\n")
    r = run(specrun, "where")
    assert r.exit_code == 0 and r.stderr == "", r.stderr

    monkeypatch.setenv("DRAFTPROOF_BUNDLE", str(fresh / "new-bundle"))
    r = run(specrun, "where")
    assert r.stdout == f"{fresh / 'new-bundle'}\n" and r.stderr == "", r.output


def test_the_old_api_key_variable_is_read_while_the_new_one_is_unset(fresh, monkeypatch):
    import draftproof.cli.serve as serve_module
    from draftproof.cli.specrun import main as specrun

    keys = []
    monkeypatch.setattr(serve_module, "_serve", lambda bundle, host, port, slots, queue, api_key,
                        *rest: keys.append(api_key))
    assert run(specrun, "serve", "-b", fresh).exit_code == 0
    monkeypatch.setenv("SPECEDGE_API_KEY", "old-key")
    r = run(specrun, "serve", "-b", fresh)
    assert r.exit_code == 0, r.output
    assert "specrun: warning: $SPECEDGE_API_KEY is deprecated" in r.stderr
    assert "$DRAFTPROOF_API_KEY" in r.stderr and "old-key" not in r.stderr
    monkeypatch.setenv("DRAFTPROOF_API_KEY", "new-key")
    assert run(specrun, "serve", "-b", fresh).exit_code == 0
    assert run(specrun, "serve", "-b", fresh, "--api-key", "flag-key").exit_code == 0
    assert keys == [None, "old-key", "new-key", "flag-key"]


@pytest.mark.parametrize("base", ["XDG_DATA_HOME", "HOME"])
def test_specedges_default_bundle_is_used_with_a_warning_only_while_draftproofs_is_absent(
        fresh, monkeypatch, base):
    if base == "HOME":
        monkeypatch.delenv("XDG_DATA_HOME")
        data = fresh / "home" / ".local" / "share"
    else:
        data = fresh / "data"
    new, old = data / "draftproof" / "default", data / "specedge" / "default"

    assert renamed_warnings(default_bundle_dir) == (new, [])  # neither: the new one, silently

    old.mkdir(parents=True)
    (old / "manifest.json").write_text("{}")
    value, said = renamed_warnings(default_bundle_dir)
    assert value == old and len(said) == 1, said
    assert said[0].startswith(f"the default bundle is specedge's {old}: specedge is now "
                              f"draftproof, whose default {new} does not exist")
    assert renamed_warnings(default_bundle_dir) == (old, [])  # said once
    # a build writes the new place (it does not replace the old bundle)
    assert renamed_warnings(default_bundle_dir, to_write=True) == (new, [])

    new.mkdir(parents=True)  # built: the new one, silently; the old one is left as it was
    monkeypatch.setattr(renamed, "_said", set())
    assert renamed_warnings(default_bundle_dir) == (new, [])
    assert [p.name for p in old.iterdir()] == ["manifest.json"]

    # a variable still wins over both directories
    monkeypatch.setenv("DRAFTPROOF_BUNDLE", str(fresh / "elsewhere"))
    assert default_bundle_dir() == fresh / "elsewhere"


def test_specrun_where_names_specedges_default_bundle_while_draftproofs_is_absent(fresh):
    from draftproof.cli.specrun import main as specrun

    old = fresh / "data" / "specedge" / "default"
    old.mkdir(parents=True)
    r = run(specrun, "where")
    assert r.exit_code == 0 and r.stdout == f"{old}\n", r.output
    assert r.stderr.startswith(f"specrun: warning: the default bundle is specedge's {old}")
    assert r.stderr.count("\n") == 1


def _real_models(monkeypatch):
    spec = importlib.util.spec_from_file_location("real_models_renamed",
                                                  ROOT / "benchmarks" / "real_models.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks itself up
    spec.loader.exec_module(module)
    return module


def test_the_model_cache_reads_specedges_while_writing_draftproofs(fresh, monkeypatch):
    real_models = _real_models(monkeypatch)
    name, m = next(iter(real_models.MODELS.items()))
    home = fresh / "home"
    new, old = home / ".cache/draftproof/models", home / ".cache/specedge/models"
    assert real_models.cache_dir() == new and real_models.cached(name) is None

    old.mkdir(parents=True)
    with open(old / m.file, "wb") as f:
        f.truncate(m.bytes)  # sparse: the size is what cached() checks
    value, said = renamed_warnings(real_models.cached, name)
    assert value == old / m.file and len(said) == 1 and "specedge's model cache" in said[0]
    assert real_models.cache_dir() == new  # fetches go to the new cache

    new.mkdir(parents=True)
    with open(new / m.file, "wb") as f:
        f.truncate(m.bytes)
    assert renamed_warnings(real_models.cached, name) == (new / m.file, [])

    monkeypatch.setenv("SPECEDGE_MODELS", str(fresh / "mine"))
    value, said = renamed_warnings(real_models.cache_dir)
    assert value == fresh / "mine" and "$SPECEDGE_MODELS is deprecated" in said[0]
    monkeypatch.setenv("DRAFTPROOF_MODELS", str(fresh / "ours"))
    assert real_models.cache_dirs() == [fresh / "ours"]
