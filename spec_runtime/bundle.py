"""Open a bundle: validate its manifest, create the engines once, wire them to a Generator."""

from __future__ import annotations

import os
from pathlib import Path

from .drafts import ModelDraft, NgramDraft
from .generator import Generator
from .chat import compile_chat_template
from .contract import graph_metadata
from .manifest import REBUILD, BundleError, read_manifest, unreadable

DEFAULT_BUNDLE_ENV = "SPECEDGE_BUNDLE"


def default_bundle_dir() -> Path:
    """Where `specexport build` writes and `specrun` looks without flags: $SPECEDGE_BUNDLE, else
    $XDG_DATA_HOME/specedge/default (~/.local/share/specedge/default)."""
    if os.environ.get(DEFAULT_BUNDLE_ENV):
        return Path(os.environ[DEFAULT_BUNDLE_ENV]).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "specedge" / "default"


def _engine(bundle_dir: Path, manifest: dict, role: str, device: str, threads):
    """One model's engine: OrtEngine over its decoder graph, or for an encoder-decoder bundle
    OrtEncDecEngine over its encoder and decoder graphs."""
    model = manifest[role]
    graph = dict(model["graphs"]["decoder"], vocab_size=model["vocab_size"])
    precision = model.get("precision", "fp32")
    # With a model draft two sessions take turns many times a round. ONNX Runtime's workers spin
    # for a while after each run, so the other session's run would compete with them for the
    # cores; not spinning at all makes every parallel operator wake sleeping workers instead.
    # Sessions that take turns therefore spin inside a run and stop as soon as it returns
    # (session.force_spinning_stop). Measured on 2 cores, fp32 SmolLM2 target with its int4
    # draft, γ 4 (`specrun bench`): always spinning 0.88× target-only, never spinning 1.37×,
    # stopping at return 1.63×. One session alone keeps spinning (it shortens its own calls).
    spinning = manifest["draft"]["kind"] != "model"
    common = dict(max_len=manifest["max_len"], prefill_chunk=manifest["prefill_chunk"],
                  device=device, threads=threads, spinning=spinning,
                  metadata=graph_metadata(role, "decoder", precision))
    if manifest["architecture"] == "encoder-decoder":
        from .ort_encdec import OrtEncDecEngine

        enc = model["graphs"]["encoder"]
        return OrtEncDecEngine(bundle_dir / graph["file"], graph, bundle_dir / enc["file"], enc,
                               max_source_len=manifest["max_source_len"], where=role,
                               encoder_metadata=graph_metadata(role, "encoder", precision),
                               **common)
    from .ort_engine import OrtEngine

    return OrtEngine(bundle_dir / graph["file"], graph, where=f"{role}.graphs.decoder", **common)


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    try:
        with open(path, "rb"):  # a file system refusal is named as such
            pass
    except OSError as e:
        raise unreadable(path, e) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise BundleError(f"{path} is not a tokenizers tokenizer.json ({e}); {REBUILD}") from None


def check_tokenizer(tokenizer, tok: dict) -> None:
    """The tokenizer must map the manifest's special tokens to the manifest's ids: a
    tokenizer.json of another model (even with its sha256 updated) fails here, before it turns
    prompts into ids that mean other words to the graphs."""
    special = tok.get("special_tokens") or {}
    expected = [("eos_token", tok["eos_token_ids"]), ("bos_token", [tok.get("bos_token_id")])]
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
                check_files: bool = True) -> Generator:
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else default_bundle_dir()
    manifest = read_manifest(bundle_dir, check_files=check_files)
    tok = manifest["tokenizer"]
    tokenizer = load_tokenizer(bundle_dir / tok["file"])
    check_tokenizer(tokenizer, tok)
    if tok.get("chat_template"):
        compile_chat_template(tok["chat_template"])  # syntax and a test render, before sessions
    target = _engine(bundle_dir, manifest, "target", device, threads)
    if tokenizer.get_vocab_size() > target.vocab_size:
        raise BundleError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the target graph only "
            f"{target.vocab_size}: the tokenizer belongs to another model; {REBUILD}"
        )
    d = manifest["draft"]
    if d["kind"] == "model":
        draft = ModelDraft(_engine(bundle_dir, manifest, "draft", device, threads))
    else:
        draft = NgramDraft(target.vocab_size, max_ngram=d.get("max_ngram") or 3,
                           min_ngram=d.get("min_ngram") or 1)
    gen = Generator(
        target,
        draft,
        tokenizer=tokenizer,
        eos_token_ids=tok["eos_token_ids"],
        default_gamma=manifest["default_gamma"],
        max_gamma=manifest["max_gamma"],
        chat_template=tok.get("chat_template"),
        special_tokens=tok.get("special_tokens"),
        encoder_decoder=manifest["architecture"] == "encoder-decoder",
        decoder_start_token_id=manifest.get("decoder_start_token_id"),
    )
    gen.manifest = manifest
    gen.bundle_dir = bundle_dir
    return gen
