"""Open a bundle: read its manifest, check what it holds, create the engines once, pick the draft
from the registry, and hand all of it to a Generator.

    manifest.json ─ read_manifest ─► Manifest (every field checked; files inside the bundle,
                                      regular files, sizes and sha256; a snapshot of the
                                      directory before, compared once everything is read)
    tokenizer.json ─ Tokenizer ─► its special tokens match the manifest's ids
    chat template ─ compiled and test-rendered (chat.py)
    --device ─ devices.device ─► Device (the registry's entry), once for the target and once
                                      for the draft
    target graphs ─ engines.open_engine ─► by the device's backend: OrtEngine (external data only
                                      from listed files; the session's I/O and metadata match the
                                      manifest), or the native TensorRT engine
    draft ─ drafts.open_draft (registry by draft.kind) ─► its own engine, or none
    target rows ─ rows.choose_one_row ─► the 1-token call form that scores like a verify call
    ────────────────────────────────────────────────────────────────► Generator
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..engines import devices, rows
from ..chat import compile_chat_template
from ..decode.drafts import draft_engines, open_draft
from ..engines.opener import open_engine, open_lanes
from ..errors import BundleError, InputError
from ..generator import Generator
from ..limits import check_threads
from .manifest import (MANIFEST, REBUILD, TokenizerEntry, name_too_long, read_manifest,
                       unreadable)
from .files import check_file_hashes, check_unchanged, regular_file, snapshot
from ..decode.stats import Costs

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


def load_bundle(bundle_dir=None, device: str = "cpu", threads: int | None = None,
                check_files: bool = True, draft_device: str | None = None,
                one_row: str = "auto") -> Generator:
    """`device` runs the target; `draft_device` (default: the same) a model draft, so that,
    say, an int4 draft drafts on the CPU while an fp16 target verifies on the GPU. `one_row`
    "auto" measures which form of a 1-token target call scores a position like a verify call
    on this machine (rows.py); "as-is" or "padded" takes that form unmeasured. `threads`: each
    CPU session's, at most the CPUs this process may run on (default: the physical cores)."""
    threads = check_threads(threads)
    target_device = devices.device(device)
    draft_device = devices.device(draft_device or device, "draft_device" if draft_device
                                  else "device")
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else default_bundle_dir()
    manifest = read_manifest(bundle_dir, check_files=False)
    if check_files:  # hashed, then read; the snapshots prove nothing changed in between
        before = snapshot(bundle_dir, [MANIFEST, *manifest.files])
        check_file_hashes(bundle_dir, manifest.to_json())
    tok = manifest.tokenizer
    tokenizer = load_tokenizer(bundle_dir / tok.file)
    check_tokenizer(tokenizer, tok)
    if tok.chat_template:
        compile_chat_template(tok.chat_template)  # syntax and a test render, before sessions
    if one_row != "auto":
        rows.given(one_row)  # a bad value is refused before the sessions open
    if manifest.draft.options.get("shared_encoder") and draft_device != target_device:
        raise InputError(f"this bundle's draft reads the target's encoder output "
                         f"(draft.shared_encoder), so it runs where the target runs: leave "
                         f"--draft-device {draft_device.name} out, or make it "
                         f"{target_device.name}")
    target = open_engine(bundle_dir, manifest, "target", manifest.target, device=target_device,
                         threads=threads)
    if tokenizer.get_vocab_size() > target.vocab_size:
        raise BundleError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the target graph only "
            f"{target.vocab_size}: the tokenizer belongs to another model; {REBUILD}"
        )
    kept = None
    if "vocab" in manifest.draft.options:  # a trimmed draft head: its kept ids, checked
        from ..decode.draft_vocab import read_kept_ids

        kept = read_kept_ids(bundle_dir, manifest.draft.options["vocab"], target.vocab_size,
                             tok.eos_token_ids)
    draft = open_draft(manifest.draft, target.vocab_size,
                       lambda model: open_engine(bundle_dir, manifest, "draft", model,
                                                 device=draft_device, threads=threads), kept)
    if check_files:
        check_unchanged(before, snapshot(bundle_dir, [MANIFEST, *manifest.files]), bundle_dir)
    row_check = rows.choose_one_row(target, one_row)
    lanes = open_lanes(bundle_dir, manifest, "target", manifest.target, target, threads=threads)
    draft_lanes = None
    if lanes is not None and draft is not None and draft_engines(draft) \
            and manifest.draft.model is not None \
            and "decoder_lanes" in manifest.draft.model.graphs:
        # its steps share lanes calls: a step must score alike in a 1-row call and in a
        # longer one, as the target's do (rows.py)
        rows.probe(draft_engines(draft)[0], role="draft")
        draft_lanes = open_lanes(bundle_dir, manifest, "draft", manifest.draft.model,
                                 draft_engines(draft)[0], threads=threads)
    return Generator(
        target,
        draft,
        row_check=row_check,
        tokenizer=tokenizer,
        eos_token_ids=tok.eos_token_ids,
        default_gamma=manifest.default_gamma,
        max_gamma=manifest.max_gamma,
        chat_template=tok.chat_template,
        special_tokens=tok.special_tokens,
        encoder_decoder=manifest.encoder_decoder,
        decoder_start_token_id=manifest.decoder_start_token_id,
        manifest=manifest,
        bundle_dir=bundle_dir,
        generation_defaults=manifest.generation,
        audio=manifest.audio,
        costs=Costs(**manifest.costs) if manifest.costs else None,
        lanes=lanes,
        draft_lanes=draft_lanes,
    )
