"""Where bundles are (the default bundle's directory) and the reads of a bundle's own files that
need nothing above the bundle layer: its manifest, its tokenizer and the tokenizer's identity.
Wiring a bundle into a model is loading.py's."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import BundleError
from .manifest import (MANIFEST, REBUILD, TokenizerEntry, name_too_long, read_manifest,
                       unreadable)
from .files import regular_file

DEFAULT_BUNDLE_ENV = "DRAFTPROOF_BUNDLE"


def data_dir() -> Path:
    """$XDG_DATA_HOME/draftproof (~/.local/share/draftproof): where the default bundle lives."""
    data = os.environ.get("XDG_DATA_HOME")
    return _usable("$XDG_DATA_HOME", data, Path(data) / "draftproof") if data \
        else Path.home() / ".local" / "share" / "draftproof"


def default_bundle_dir() -> Path:
    """Where `specexport build` writes and `specrun` looks without flags: $DRAFTPROOF_BUNDLE
    (when set and not empty), else $XDG_DATA_HOME/draftproof/default
    (~/.local/share/draftproof/default)."""
    value = os.environ.get(DEFAULT_BUNDLE_ENV)
    if value:
        return _usable(f"${DEFAULT_BUNDLE_ENV}", value, Path(value).expanduser())
    return data_dir() / "default"


def _usable(variable: str, value: str, path: Path) -> Path:
    """`path`, from an environment variable's `value`, unless no file system can hold it."""
    why = name_too_long(path / MANIFEST)
    if why:
        raise BundleError(f"{variable} {value!r} cannot name a directory: {why}: set it to a "
                          f"shorter path")
    return path


def read_bundle_manifest(bundle_dir=None):
    """The manifest of the bundle at `bundle_dir` (the default bundle when None), read and
    checked, its files not hashed: what a caller may know of a bundle before loading it."""
    return read_manifest(Path(bundle_dir) if bundle_dir is not None else default_bundle_dir(),
                         check_files=False)


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    regular_file(path)
    try:
        with open(path, "rb"):  # a file system refusal is named as such
            pass
    except OSError as e:
        raise unreadable(path, e) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise BundleError(f"{path} is not a tokenizers tokenizer.json ({e}); {REBUILD}") from None


def vocabulary_sha256(tokenizer) -> str:
    """sha256 of every (token, id) the tokenizer maps, added tokens included, by id."""
    items = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def check_tokenizer(tokenizer, tok: TokenizerEntry) -> None:
    """The tokenizer must map the manifest's special tokens to the manifest's ids, and every
    token to the id it had at the build: a tokenizer.json of another model, or one cut or
    rotated (even with its sha256 updated), fails here, before it turns prompts into ids that
    mean other words to the graphs."""
    if tok.vocab_sha256 is not None and vocabulary_sha256(tokenizer) != tok.vocab_sha256:
        raise BundleError(f"tokenizer.json maps tokens to other ids than the tokenizer the "
                          f"bundle was built with ({tokenizer.get_vocab_size()} tokens; its "
                          f"vocabulary's sha256 differs from the manifest's): it was edited or "
                          f"belongs to another model; {REBUILD}")
    special = tok.special_tokens
    expected = [("eos_token", list(tok.eos_token_ids)), ("bos_token", [tok.bos_token_id])]
    for key, ids in expected:
        text = special.get(key)
        if not text or not ids or None in ids:
            continue
        got = tokenizer.token_to_id(text)
        if got not in ids:
            raise BundleError(
                f"tokenizer.json maps the {key} {text!r} to {got!r}, the manifest says "
                f"{ids[0] if len(ids) == 1 else ids!r}: the tokenizer belongs to another model; "
                f"{REBUILD}"
            )
