"""`specrun list`: the bundles on this machine, read from their manifests. The oracle is each
bundle's manifest.json as JSON and the sizes of its files on disk."""

import json
import shutil
from pathlib import Path

from helpers import assert_input_error, run

from draftproof.cli.specrun import main as specrun


def expected(bundle: Path) -> dict:
    m = json.loads((bundle / "manifest.json").read_text())
    return {"path": str(bundle), "target": Path(m["target"]["source"]).name,
            "precision": m["target"]["precision"], "max_len": m["max_len"],
            "size_bytes": sum(f.stat().st_size for f in bundle.iterdir())}


def listed(*args) -> list[dict]:
    r = run(specrun, "list", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_the_default_bundle_and_those_beside_it(llama_pair, gpt2_pair, tmp_path, monkeypatch):
    data = tmp_path / "data"
    home = data / "draftproof"
    home.mkdir(parents=True)
    shutil.copytree(gpt2_pair[2], home / "gpt2")
    (home / "notes").mkdir()  # not a bundle: left out
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    monkeypatch.setenv("DRAFTPROOF_BUNDLE", str(llama_pair[2]))
    rows = listed()
    assert [r["path"] for r in rows] == [str(llama_pair[2]), str(home / "gpt2")]
    assert [r["default"] for r in rows] == [True, False]
    for row, bundle in zip(rows, (llama_pair[2], home / "gpt2")):
        assert {k: row[k] for k in expected(bundle)} == expected(bundle)
    assert rows[0]["draft"].startswith("model") and rows[1]["draft"].startswith("model")
    text = run(specrun, "list").stdout
    assert text.splitlines()[1].startswith("*  " + str(llama_pair[2]))
    assert "gpt2" in text and "notes" not in text

    # without $DRAFTPROOF_BUNDLE the default is the data directory's `default`, when built
    monkeypatch.delenv("DRAFTPROOF_BUNDLE")
    shutil.copytree(llama_pair[2], home / "default")
    rows = listed()
    assert [(Path(r["path"]).name, r["default"]) for r in rows] == [("default", True),
                                                                    ("gpt2", False)]


def test_given_directories_and_what_is_not_a_bundle(llama_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("DRAFTPROOF_BUNDLE", raising=False)
    assert run(specrun, "list").stdout.startswith("no bundles found")
    folder = tmp_path / "bundles"
    shutil.copytree(llama_pair[2], folder / "a")
    shutil.copytree(llama_pair[2], folder / "b")
    (folder / "b" / "manifest.json").write_text("{not json")
    rows = listed(folder / "a")
    assert [r["path"] for r in rows] == [str(folder / "a")] and rows[0]["default"] is False
    rows = listed(folder)  # a folder of bundles: a damaged one is named with its reason
    assert rows[0]["size_bytes"] == expected(folder / "a")["size_bytes"]
    assert rows[1]["path"] == str(folder / "b") and "manifest" in rows[1]["error"]
    assert "not a usable bundle" in run(specrun, "list", folder).stdout
    assert_input_error(run(specrun, "list", tmp_path / "nowhere"), "nowhere", "not a directory")
