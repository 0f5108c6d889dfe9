"""The bundle manifest: the only contract between `specexport` and the runtime, described once.

A bundle is a directory holding `manifest.json`, `tokenizer.json` and the graphs. `Manifest` and
its entries are the typed description of that file: the exporter builds one and writes it with
`write_manifest` (the one writer), the runtime gets one from `read_manifest` (the one reader,
which validates everything first, see manifest_checks.py, and never changes what it read). Each
graph's inputs and outputs follow the graph contract of contract.py.

Schema history (the reader takes every version in READABLE_SCHEMAS; a newer one is refused with
the upgrade command, an older one with the rebuild command):
1 — every graph writes only the new cache slots (`present` [.., n, ..]).
2 — each graph records `kernels` ("portable": standard ONNX ops; "fused": ONNX Runtime contrib
    ops) and `kv_cache` ("new-slots", as in 1; "in-place": `present` is the whole cache, written
    where it lies). A version-1 reader must not run an in-place graph, hence the new version.
    Graphs built since carry metadata (specedge.role, .graph, .precision: the format's keys
    keep the project's first name) that the reader checks when present.
3 — `default_gamma` may be "auto" (the runtime chooses each round's draft length: loop.py's
    GammaPolicy); a version-2 reader would refuse the string, hence the new version.
4 — a model draft may hold `draft.vocab` (a head trimmed to some of the target's ids, listed in
    a bundle file: draft_vocab.py); a version-3 reader would take its logits for ids 0..N-1.
    A build writes 4 only for such a draft (`lowest_schema`), so that older readers keep
    reading the others.
5 — speech bundles (Whisper): `audio` (AudioEntry), an encoder that reads log-mel features
    (`input_features`) and a decoder without `source_mask`; and an encoder-decoder's draft
    that reads the target's encoder output (`draft.shared_encoder`: a decoder graph only).
    Written only for them.
6 — batched decoding (`specexport build --max-batch N`): a top-level `max_batch` (1 where
    absent) and, with max_batch > 1, a "decoder_lanes" graph (contract.decoder_lanes_io, N
    lanes) beside the target's fused decoder graph, and beside a model draft's where it is
    fused. Written only for such bundles: older readers would take a max_batch > 1 bundle for
    a plain one.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from .contract import graph_devices
from ..errors import BundleError
from .checks import (AUDIO_SINCE, BATCH_SINCE, COSTS, LANES_GRAPH, REBUILD, SCHEMA_1_DEFAULTS,
                     VOCAB_SINCE, depth, validate)
from .files import (check_file_hashes, check_inside, name_limit, name_too_long, regular_file,
                    sha256_file, unreadable)

__all__ = ["COSTS", "LANES_GRAPH", "BundleError", "DraftEntry", "FileEntry", "GraphEntry",
           "Manifest", "ModelEntry", "REBUILD", "TokenizerEntry", "lowest_schema", "name_limit",
           "name_too_long", "read_manifest", "sha256_file", "unreadable", "write_manifest"]

SCHEMA_VERSION = 6
READABLE_SCHEMAS = (1, 2, 3, 4, 5, 6)
FORMAT = "specedge-bundle"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a real one is a few kB; the chat template is the largest part
MAX_DEPTH = 32  # a manifest nests a handful of levels (files -> name -> bytes)


@dataclass(frozen=True)
class GraphEntry:
    """One ONNX file and its inputs and outputs as the contract describes them."""

    file: str
    inputs: list[dict]
    outputs: list[dict]
    kernels: str = "portable"
    kv_cache: str = "new-slots"
    opset: int | None = None
    devices: tuple[str, ...] = ()  # where it runs (contract.graph_devices); () = not recorded

    @property
    def description(self) -> tuple[list[dict], list[dict]]:
        return self.inputs, self.outputs


@dataclass(frozen=True)
class ModelEntry:
    """A model's graphs ("decoder", and "encoder" for an encoder-decoder; "decoder_lanes", the
    batched decoder of a bundle with max_batch > 1) and what it is."""

    vocab_size: int
    graphs: dict[str, GraphEntry]
    precision: str = "fp32"
    family: str | None = None
    source: str | None = None
    gguf_file: str | None = None
    dims: dict | None = None
    parity: dict | None = None
    quantization: dict | None = None


@dataclass(frozen=True)
class DraftEntry:
    """`kind` names an entry of the draft registry (drafts.DRAFTS); `model` holds a draft's own
    graphs where it has any; `options` are the kind's own settings (n-gram sizes), checked by
    the draft that reads them."""

    kind: str
    model: ModelEntry | None = None
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerEntry:
    file: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    special_tokens: dict = field(default_factory=dict)
    chat_template: str | None = None
    # sha256 of the vocabulary as the tokenizer maps it (bundle.vocabulary_sha256): a
    # tokenizer.json edited and re-hashed still has to map every token to the same id
    vocab_sha256: str | None = None


@dataclass(frozen=True)
class AudioEntry:
    """What a speech model (Whisper) reads and how its decoder is prompted: `n_mels` mel bins
    of one window (frames = 2 * max_source_len); the prompt <|startoftranscript|> (the
    manifest's decoder_start_token_id), then a language token (`languages`: "en" -> id; empty
    for an English-only model, which has none), a task token (`tasks`: "transcribe",
    "translate"), then <|notimestamps|>; the ids the model's generation_config never lets it
    emit (`suppress_tokens`) and those it may not emit first (`begin_suppress_tokens`).
    `timestamps`, for a model whose vocabulary has timestamp tokens (the ids after
    <|notimestamps|>), is what its timestamp rules read: {"max_initial_timestamp_index": the
    last timestamp allowed first, or None for any, "prev_sot_token_id": <|startofprev|>};
    None where the model has none, or the bundle was built before they were recorded."""

    n_mels: int
    languages: dict[str, int] = field(default_factory=dict)
    tasks: dict[str, int] = field(default_factory=dict)
    no_timestamps_token_id: int | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    timestamps: dict | None = None

    def to_json(self) -> dict:
        return {"n_mels": self.n_mels, "languages": dict(self.languages),
                "tasks": dict(self.tasks), "no_timestamps_token_id": self.no_timestamps_token_id,
                "suppress_tokens": list(self.suppress_tokens),
                "begin_suppress_tokens": list(self.begin_suppress_tokens),
                "timestamps": None if self.timestamps is None else dict(self.timestamps)}

    @classmethod
    def from_json(cls, d: dict) -> "AudioEntry":
        stamps = d.get("timestamps")
        return cls(d["n_mels"], dict(d["languages"]), dict(d["tasks"]),
                   d.get("no_timestamps_token_id"), tuple(d["suppress_tokens"]),
                   tuple(d["begin_suppress_tokens"]),
                   None if stamps is None else dict(stamps))


@dataclass(frozen=True)
class FileEntry:
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    architecture: str  # "decoder-only" or "encoder-decoder"
    max_len: int  # KV cache capacity: prompt + new tokens
    max_gamma: int
    default_gamma: int | str  # or "auto" (schema 3; gamma.parse_gamma reads it)
    prefill_chunk: int
    target: ModelEntry
    draft: DraftEntry
    tokenizer: TokenizerEntry
    precision: str = "fp32"
    max_source_len: int | None = None  # encoder-decoder: the encoder's static source length
    decoder_start_token_id: int | None = None  # encoder-decoder: the decoder's first token
    files: dict[str, FileEntry] = field(default_factory=dict)
    created_by: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # engines built from the graphs on the machine that runs them (`specexport engine`):
    # {"tensorrt": {"tensorrt_version", "gpu", "compute_capability", "fp16", "workspace_mb",
    #               "graphs": {"target/decoder": file, ...}}}
    engines: dict = field(default_factory=dict)
    # the model's own sampling defaults (its generation_config), which generate() and specrun
    # use for what a request leaves unset: {"temperature", "top_k", "top_p", "min_p",
    # "repetition_penalty"} (absent = greedy, no truncation, no penalty)
    generation: dict = field(default_factory=dict)
    # auto γ's prices, in target steps, measured at build on the building machine (stats.Costs:
    # {"draft_step", "verify_row"}); a seeded sample's rounds take them instead of their own
    # timings. Absent in bundles built before they were measured: an older reader ignores them.
    costs: dict = field(default_factory=dict)
    audio: AudioEntry | None = None  # a speech bundle's (schema 5)
    # the most sequences one batched call decodes: the lanes of every "decoder_lanes" graph
    # (schema 6); 1 = no batched graphs, what every bundle before schema 6 is
    max_batch: int = 1

    @property
    def encoder_decoder(self) -> bool:
        return self.architecture == "encoder-decoder"

    def models(self) -> list[tuple[str, ModelEntry]]:
        """(role, entry) of every model with graphs: the target, and a draft with its own."""
        return [("target", self.target)] + ([("draft", self.draft.model)]
                                            if self.draft.model is not None else [])

    # -- the one writer's format ----------------------------------------------------------------

    def to_json(self) -> dict:
        d = {"format": FORMAT, "schema_version": self.schema_version,
             "architecture": self.architecture, "max_len": self.max_len,
             "max_gamma": self.max_gamma, "default_gamma": self.default_gamma,
             "prefill_chunk": self.prefill_chunk, "precision": self.precision,
             "target": _model_json(self.target),
             "draft": {"kind": self.draft.kind, **(_model_json(self.draft.model)
                                                    if self.draft.model else {}),
                       **self.draft.options},
             "tokenizer": {"file": self.tokenizer.file,
                           "eos_token_ids": list(self.tokenizer.eos_token_ids),
                           "bos_token_id": self.tokenizer.bos_token_id,
                           "special_tokens": dict(self.tokenizer.special_tokens),
                           "chat_template": self.tokenizer.chat_template,
                           **({"vocab_sha256": self.tokenizer.vocab_sha256}
                              if self.tokenizer.vocab_sha256 else {})},
             "created_by": self.created_by,
             "files": {n: {"bytes": f.bytes, "sha256": f.sha256} for n, f in self.files.items()}}
        if self.engines:
            d["engines"] = self.engines
        if self.generation:
            d["generation"] = dict(self.generation)
        if self.costs:
            d["costs"] = dict(self.costs)
        if self.encoder_decoder:
            d.update(max_source_len=self.max_source_len,
                     decoder_start_token_id=self.decoder_start_token_id)
        if self.audio is not None:
            d["audio"] = self.audio.to_json()
        if self.max_batch != 1:  # absent: 1, so a bundle without batching reads as before
            d["max_batch"] = self.max_batch
        return d

    # -- the one reader -------------------------------------------------------------------------

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        """Validate `d` (manifest_checks.validate) and describe it; `d` is not changed."""
        validate(d)
        d = copy.deepcopy(d)
        draft = d["draft"]
        model_keys = set(ModelEntry.__dataclass_fields__)
        draft_model = _model(draft) if "graphs" in draft else None
        options = {k: v for k, v in draft.items() if k != "kind" and k not in model_keys}
        tok = d["tokenizer"]
        return cls(
            architecture=d["architecture"], max_len=d["max_len"], max_gamma=d["max_gamma"],
            default_gamma=d["default_gamma"], prefill_chunk=d["prefill_chunk"],
            target=_model(d["target"]),
            draft=DraftEntry(draft["kind"], draft_model, options),
            tokenizer=TokenizerEntry(tok["file"], tuple(tok["eos_token_ids"]),
                                     tok.get("bos_token_id"), tok.get("special_tokens") or {},
                                     tok.get("chat_template"), tok.get("vocab_sha256")),
            precision=d.get("precision", "fp32"), max_source_len=d.get("max_source_len"),
            decoder_start_token_id=d.get("decoder_start_token_id"),
            files={n: FileEntry(f["bytes"], f["sha256"]) for n, f in d["files"].items()},
            created_by=d.get("created_by") or {}, schema_version=d["schema_version"],
            engines=d.get("engines") or {}, generation=d.get("generation") or {},
            costs=d.get("costs") or {},
            audio=AudioEntry.from_json(d["audio"]) if d.get("audio") is not None else None,
            max_batch=d.get("max_batch", 1))


def _model(d: dict) -> ModelEntry:
    precision = d.get("precision", "fp32")

    def graph(g: dict) -> GraphEntry:
        kernels = g.get("kernels", SCHEMA_1_DEFAULTS["kernels"])
        return GraphEntry(file=g["file"], inputs=g["inputs"], outputs=g["outputs"],
                          kernels=kernels, kv_cache=g.get("kv_cache", SCHEMA_1_DEFAULTS["kv_cache"]),
                          opset=g.get("opset"),
                          devices=tuple(g.get("devices") or graph_devices(kernels, precision)))

    graphs = {name: graph(g) for name, g in d["graphs"].items()}
    return ModelEntry(vocab_size=d["vocab_size"], graphs=graphs,
                      precision=d.get("precision", "fp32"), family=d.get("family"),
                      source=d.get("source"), gguf_file=d.get("gguf_file"), dims=d.get("dims"),
                      parity=d.get("parity"), quantization=d.get("quantization"))


def _model_json(m: ModelEntry) -> dict:
    return {"family": m.family, "source": m.source, "gguf_file": m.gguf_file, "dims": m.dims,
            "vocab_size": m.vocab_size, "precision": m.precision,
            "quantization": m.quantization, "parity": m.parity,
            "graphs": {name: {"file": g.file, "inputs": g.inputs, "outputs": g.outputs,
                              "opset": g.opset, "kernels": g.kernels, "kv_cache": g.kv_cache,
                              "devices": list(g.devices or graph_devices(g.kernels, m.precision))}
                       for name, g in m.graphs.items()}}


def lowest_schema(draft: DraftEntry, audio: bool = False, max_batch: int = 1) -> int:
    """The oldest schema that describes a bundle with this draft (and of speech, with
    `audio`; with lanes graphs, with `max_batch` > 1): what a build writes."""
    if max_batch > 1:
        return BATCH_SINCE
    if audio or draft.options.get("shared_encoder"):
        return AUDIO_SINCE
    return VOCAB_SINCE if "vocab" in draft.options else VOCAB_SINCE - 1


def read_manifest(bundle_dir, check_files: bool = True) -> Manifest:
    """Read and validate `bundle_dir/manifest.json`; with check_files, every listed file must
    exist with its recorded size and sha256."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    why = name_too_long(path)
    if why:
        raise BundleError(f"no bundle can be at {str(bundle_dir)!r}: {why}: give a shorter path")
    if not bundle_dir.is_dir():
        raise BundleError(f"no bundle at {str(bundle_dir)!r}: build one there with "
                          f"`specexport build --out {shlex.quote(str(bundle_dir))}`")
    if not path.exists():
        raise BundleError(f"{str(bundle_dir)!r} has no {MANIFEST}: it is not a complete bundle; "
                          f"{REBUILD}")
    check_inside(bundle_dir, [MANIFEST])
    regular_file(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise unreadable(path, e) from None
    d = _checked_json(data, path)
    manifest = Manifest.from_json(d)
    check_inside(bundle_dir, list(d["files"]))
    if check_files:
        check_file_hashes(bundle_dir, d)
    return manifest


def parse_manifest(data: bytes, path) -> Manifest:
    """The manifest that the bytes `data` (read from `path`, named in messages) hold, checked
    as `read_manifest` checks it, but not the files it lists."""
    return Manifest.from_json(_checked_json(data, path))


def _checked_json(data: bytes, path) -> dict:
    if len(data) > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MB, far more than "
                          f"any manifest; {REBUILD}")
    try:
        d = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BundleError(f"{path} is not valid JSON ({reason}); {REBUILD}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise BundleError(f"{path} is not a draftproof bundle manifest; {REBUILD}")
    if depth(d, MAX_DEPTH) > MAX_DEPTH:
        raise BundleError(f"{path} nests its values more than {MAX_DEPTH} deep, where a "
                          f"manifest needs a few levels; {REBUILD}")
    version = d.get("schema_version")
    if version not in READABLE_SCHEMAS or isinstance(version, bool):
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            hint = "upgrade draftproof (`pip install -U draftproof`) to read it"
        else:
            hint = REBUILD
        raise BundleError(f"bundle schema_version {version!r}, this runtime reads "
                          f"{list(READABLE_SCHEMAS)}: {hint}")
    return d


def write_manifest(bundle_dir: Path, manifest: Manifest) -> Manifest:
    """Record size and sha256 of every file in `bundle_dir`, then write manifest.json last (to a
    temporary name first, so that a manifest is whole or absent; a file of that name, which
    the caller may have created empty beforehand, is not a bundle file). Returns what was written,
    read back through the reader: the writer never writes what the reader would refuse."""
    tmp = Path(bundle_dir) / (MANIFEST + ".tmp")
    files = {p.name: FileEntry(p.stat().st_size, sha256_file(p))
             for p in sorted(Path(bundle_dir).iterdir())
             if p.is_file() and p.name not in (MANIFEST, tmp.name)}
    written = Manifest.from_json(replace(manifest, files=files).to_json())
    # allow_nan=False: NaN and Infinity are not JSON; a value that is not finite is a bug here
    tmp.write_text(json.dumps(written.to_json(), indent=2, allow_nan=False) + "\n",
                   encoding="utf-8")
    os.replace(tmp, Path(bundle_dir) / MANIFEST)
    return written

