"""Open a bundle: read its manifest, check what it holds, create the engines once, pick the draft
from the registry, and hand all of it to a Generator.

    manifest.json ─ read_manifest ─► Manifest (every field checked; files inside the bundle,
                                      regular files, sizes and sha256; a snapshot of the
                                      directory before, compared once everything is read)
    tokenizer.json ─ Tokenizer ─► its special tokens match the manifest's ids
    chat template ─ compiled and test-rendered (chat.py)
    target graphs ─ OrtEngine.open ─► external data only from listed files; the session's I/O
                                      and metadata match the manifest
    draft ─ drafts.open_draft (registry by draft.kind) ─► its own engine, or none
    target rows ─ rows.choose_one_row ─► the 1-token call form that scores like a verify call
    ────────────────────────────────────────────────────────────────► Generator
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from . import rows
from .chat import compile_chat_template
from .contract import graph_metadata
from .drafts import open_draft
from .errors import BundleError, InputError
from .generator import Generator
from .manifest import (MANIFEST, REBUILD, Manifest, ModelEntry, TokenizerEntry, read_manifest,
                       unreadable)
from .manifest_checks import check_file_hashes, check_unchanged, regular_file, snapshot

DEFAULT_BUNDLE_ENV = "SPECEDGE_BUNDLE"


def data_dir() -> Path:
    """$XDG_DATA_HOME/specedge (~/.local/share/specedge): where the default bundle lives."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "specedge"


def default_bundle_dir() -> Path:
    """Where `specexport build` writes and `specrun` looks without flags: $SPECEDGE_BUNDLE, else
    $XDG_DATA_HOME/specedge/default (~/.local/share/specedge/default)."""
    if os.environ.get(DEFAULT_BUNDLE_ENV):
        return Path(os.environ[DEFAULT_BUNDLE_ENV]).expanduser()
    return data_dir() / "default"


# the build that makes a graph a device can run, for the refusal of one it cannot
DEVICE_BUILDS = {
    "cuda": "`specexport build --precision fp16` (fused float16 graphs run on CUDA), or "
            "`--kernels portable`",
    "tensorrt": "`specexport build --kernels portable --precision fp16` (TensorRT runs "
                "standard ONNX only: no fused or quantized kernels)",
    "cpu": "`specexport build`",
}


def tensorrt_cache_dir(bundle_dir: Path) -> Path:
    """Where ONNX Runtime's TensorRT provider keeps the engines it builds for a bundle: beside
    it, not inside (a bundle holds exactly the files its manifest lists)."""
    return bundle_dir.parent / f"{bundle_dir.name}.trt-cache"


def open_engine(bundle_dir: Path, manifest: Manifest, role: str, model: ModelEntry, *,
                device: str, threads: int | None):
    """One model's engine on `device`: OrtEngine over its decoder graph, or for an
    encoder-decoder bundle OrtEncDecEngine over its encoder and decoder graphs; on "tensorrt",
    the native TensorRT engine when `specexport engine` built one."""
    from .kv_cache import device as kv_device
    from .ort_engine import provider_options, require_provider

    native = (manifest.engines.get("tensorrt") or {}).get("graphs", {}).get(f"{role}/decoder")
    if device == "tensorrt" and native:
        return open_tensorrt_engine(bundle_dir, manifest, role, model, native,
                                    kv_device(device).device_id)
    dev = require_provider(device)
    for name, graph in model.graphs.items():
        check_external_data(bundle_dir, manifest, graph.file)
        if dev.name not in graph.devices:
            raise BundleError(
                f"the bundle's {role} {name} graph ({model.precision}, {graph.kernels} kernels) "
                f"runs on {list(graph.devices)}, not on {dev.name!r}: build one for it with "
                f"{DEVICE_BUILDS[dev.name]}")
    cache_dir = None
    if dev.name == "tensorrt":
        cache_dir = tensorrt_cache_dir(bundle_dir)
        try:
            cache_dir.mkdir(exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create the TensorRT engine cache {str(cache_dir)!r} "
                             f"({e.strerror}): make its parent writable, or copy the bundle "
                             f"somewhere writable") from None
    # With a model draft two sessions take turns many times a round. ONNX Runtime's workers spin
    # for a while after each run, so the other session's run would compete with them for the
    # cores; not spinning at all makes every parallel operator wake sleeping workers instead.
    # Sessions that take turns therefore spin inside a run and stop as soon as it returns
    # (session.force_spinning_stop; measured in README, Performance). One session alone keeps
    # spinning (it shortens its own calls).
    spinning = manifest.draft.model is None
    decoder = model.graphs["decoder"]

    def options(graph):
        return provider_options(dev, graph.inputs, precision=model.precision,
                                max_len=manifest.max_len, max_gamma=manifest.max_gamma,
                                prefill_chunk=manifest.prefill_chunk, cache_dir=cache_dir)

    common = dict(vocab_size=model.vocab_size, max_len=manifest.max_len,
                  prefill_chunk=manifest.prefill_chunk, device=dev, threads=threads,
                  spinning=spinning, metadata=graph_metadata(role, "decoder", model.precision),
                  provider_options=options(decoder))
    if manifest.encoder_decoder:
        from .ort_encdec import OrtEncDecEngine

        encoder = model.graphs["encoder"]
        return OrtEncDecEngine.open(
            bundle_dir / decoder.file, decoder, bundle_dir / encoder.file, encoder,
            max_source_len=manifest.max_source_len, where=role,
            encoder_metadata=graph_metadata(role, "encoder", model.precision),
            encoder_provider_options=options(encoder), **common)
    from .ort_engine import OrtEngine

    return OrtEngine.open(bundle_dir / decoder.file, decoder, where=f"{role}.graphs.decoder",
                          **common)


def open_tensorrt_engine(bundle_dir: Path, manifest: Manifest, role: str, model: ModelEntry,
                         file: str, device_id: int = 0):
    """The native TensorRT engine `specexport engine` built for this role, on GPU `device_id`,
    after checking that this machine's TensorRT and that GPU are the ones it was built for."""
    from .contract import token_profile
    from .device_memory import gpu_identity
    from .trt_engine import TrtEngine, check_compatible, import_tensorrt

    trt = import_tensorrt()
    record = manifest.engines["tensorrt"]
    check_compatible(record, {"tensorrt_version": str(trt.__version__),
                              **gpu_identity(device_id)}, bundle_dir)
    return TrtEngine(bundle_dir / file, model.graphs["decoder"], vocab_size=model.vocab_size,
                     max_len=manifest.max_len, prefill_chunk=manifest.prefill_chunk,
                     max_tokens=token_profile(manifest.max_gamma, manifest.prefill_chunk)[2],
                     device_id=device_id, trt=trt)


def check_external_data(bundle_dir: Path, manifest: Manifest, file: str) -> None:
    """A graph may keep its weights in other files (external data, for graphs past 2 GB):
    each must be one the manifest lists, so that it was hashed with the rest; a graph that
    names any other file would load bytes no check has seen."""
    from .onnx_refs import NotProtobuf, external_files

    path = bundle_dir / file
    regular_file(path, file)
    try:
        refs = external_files(path)
    except NotProtobuf as e:
        raise BundleError(f"{file} is not an ONNX graph ({e}); {REBUILD}") from None
    except OSError as e:
        raise unreadable(path, e) from None
    unlisted = sorted(r for r in refs if r not in manifest.files)
    if unlisted:
        raise BundleError(f"{file} reads its weights from {unlisted[0]!r}, a file the manifest "
                          f"does not list, so no sha256 vouches for it; {REBUILD}")


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
    on this machine (rows.py); "as-is" or "padded" takes that form unmeasured."""
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
    target = open_engine(bundle_dir, manifest, "target", manifest.target, device=device,
                         threads=threads)
    if tokenizer.get_vocab_size() > target.vocab_size:
        raise BundleError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the target graph only "
            f"{target.vocab_size}: the tokenizer belongs to another model; {REBUILD}"
        )
    draft = open_draft(manifest.draft, target.vocab_size,
                       lambda model: open_engine(bundle_dir, manifest, "draft", model,
                                                 device=draft_device or device, threads=threads))
    if check_files:
        check_unchanged(before, snapshot(bundle_dir, [MANIFEST, *manifest.files]), bundle_dir)
    row_check = rows.choose_one_row(target, one_row)
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
    )
