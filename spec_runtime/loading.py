"""The composition root: open a bundle into a model. Read its manifest, check what it holds,
create the engines once, pick the draft from the registry, and hand all of it to a Generator.
The one module that wires the layers below it together (bundle, engines, decode, the model);
the apps above it call `spec_runtime.load`, which is `load_bundle`.

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

from pathlib import Path

from .bundle.files import check_file_hash, check_file_hashes, check_unchanged, snapshot
from .bundle.manifest import MANIFEST, REBUILD, read_manifest
from .bundle.reader import check_tokenizer, default_bundle_dir, load_tokenizer
from .chat import compile_chat_template
from .decode.drafts import draft_engines, open_draft
from .decode.sampling import GENERATION_CONFIG_KEYS, SamplingParams
from .engines import devices, rows
from .engines.opener import open_engine, open_lanes
from .errors import BundleError, InputError
from .generator import Generator
from .limits import check_threads


def load_bundle(bundle_dir=None, device: str = "cpu", threads: int | None = None,
                check_files: bool = True, draft_device: str | None = None,
                one_row: str = "auto") -> Generator:
    """`device` runs the target; `draft_device` (default: the same) a model draft, so that,
    say, an int4 draft drafts on the CPU while an fp16 target verifies on the GPU. `one_row`
    "auto" measures which form of a 1-token target call scores a position like a verify call
    on this machine (rows.py); "as-is" or "padded" takes that form unmeasured. `threads`: each
    CPU session's, at most the CPUs this process may run on (default: the physical cores)."""
    threads = check_threads(threads)
    one_row = rows.parse_one_row(one_row)  # a bad value is refused before anything is read
    target_device = devices.device(device)
    draft_device = devices.device(draft_device or device, "draft_device" if draft_device
                                  else "device")
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else default_bundle_dir()
    manifest = read_manifest(bundle_dir, check_files=False)
    if check_files:  # hashed, then read; the snapshots prove nothing changed in between
        before = snapshot(bundle_dir, [MANIFEST, *manifest.files])
        check_file_hashes(bundle_dir, manifest.to_json())
    check_generation(manifest.generation)
    tok = manifest.tokenizer
    tokenizer = load_tokenizer(bundle_dir / tok.file)
    check_tokenizer(tokenizer, tok)
    if tok.chat_template:
        compile_chat_template(tok.chat_template)  # syntax and a test render, before sessions
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
        from .decode.draft_vocab import read_kept_ids

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
    return Generator(target, draft, tokenizer=tokenizer, manifest=manifest, bundle_dir=bundle_dir,
                     row_check=row_check, lanes=lanes, draft_lanes=draft_lanes)


def open_tokenizer(bundle_dir=None):
    """A bundle's tokenizer alone (`specrun tokenize`), checked as `load_bundle` checks it (its
    file's sha256, the manifest's special tokens), no graph opened."""
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else default_bundle_dir()
    manifest = read_manifest(bundle_dir, check_files=False)
    tok = manifest.tokenizer
    entry = manifest.files[tok.file]
    check_file_hash(bundle_dir, tok.file, {"bytes": entry.bytes, "sha256": entry.sha256})
    tokenizer = load_tokenizer(bundle_dir / tok.file)
    check_tokenizer(tokenizer, tok)
    return tokenizer


def check_generation(generation: dict | None) -> None:
    """The manifest's sampling defaults (`generation`): keys SamplingParams reads from a
    model's generation_config, with values it accepts; BundleError naming the first that is
    not."""
    for key, value in (generation or {}).items():
        if key not in GENERATION_CONFIG_KEYS:
            raise BundleError(f"manifest generation.{key} is {value!r}: the keys are "
                              f"{list(GENERATION_CONFIG_KEYS)}; {REBUILD}")
        try:
            SamplingParams(**{key: value})
        except InputError as e:
            raise BundleError(f"manifest generation.{key}: {e}; {REBUILD}") from None
