"""The bundle manifest: the only contract between `specexport` and the runtime.

A bundle is a directory holding `manifest.json`, `tokenizer.json` and the graphs. The exporter
writes the manifest with `SCHEMA_VERSION`; the runtime reads the versions in `READABLE_SCHEMAS`
and refuses any other, any missing file and any file whose sha256 differs, each with a hint
naming the command that fixes it.

Schema history: 1 — every graph writes only the new cache slots (`present` [.., n, ..]).
2 — each graph records `kernels` ("portable": standard ONNX ops; "fused": ONNX Runtime contrib
ops) and `kv_cache` ("new-slots", as in 1; "in-place": `present` is the whole cache, written
where it lies). A version-1 reader must not run an in-place graph, hence the new version.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
FORMAT = "specedge-bundle"
MANIFEST = "manifest.json"
REBUILD = "re-run `specexport build`"

ARCHITECTURES = ("decoder-only", "encoder-decoder")
# graphs every model entry (target, and a model draft) must hold, per architecture
GRAPHS = {"decoder-only": ("decoder",), "encoder-decoder": ("encoder", "decoder")}
DRAFT_KINDS = ("model", "ngram")
PRECISIONS = ("fp32", "int8", "int4")  # graph precisions this runtime runs
KERNELS = ("portable", "fused")
KV_CACHE_LAYOUTS = ("new-slots", "in-place")


class BundleError(ValueError):
    """A bundle that cannot be used; the message names the problem and the fix."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _require(d: dict, key: str, types, where: str):
    if key not in d:
        raise BundleError(f"manifest {where} lacks {key!r}: the bundle is incomplete; {REBUILD}")
    if not isinstance(d[key], types) or isinstance(d[key], bool) and types is not bool:
        raise BundleError(f"manifest {where}.{key} is {d[key]!r}, of the wrong type; {REBUILD}")
    return d[key]


def read_manifest(bundle_dir, check_files: bool = True) -> dict:
    """Read and validate `bundle_dir/manifest.json`; with check_files, every listed file must
    exist with its recorded size and sha256."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    if not bundle_dir.is_dir():
        raise BundleError(f"no bundle at {str(bundle_dir)!r}: build one with `specexport build`")
    if not path.is_file():
        raise BundleError(f"{str(bundle_dir)!r} has no {MANIFEST}: it is not a complete bundle; "
                          f"{REBUILD}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON ({e}); {REBUILD}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{path} is not a specedge manifest; {REBUILD}")
    version = manifest.get("schema_version")
    if version not in READABLE_SCHEMAS or isinstance(version, bool):
        if isinstance(version, int) and version > SCHEMA_VERSION:
            hint = "upgrade specedge (`pip install -U specedge`) to read it"
        else:
            hint = REBUILD
        raise BundleError(f"bundle schema_version {version!r}, this runtime reads "
                          f"{list(READABLE_SCHEMAS)}: {hint}")
    validate(manifest)
    if check_files:
        check_file_hashes(bundle_dir, manifest)
    return manifest


def validate(m: dict) -> None:
    arch = _require(m, "architecture", str, "")
    if arch not in ARCHITECTURES:
        raise BundleError(f"manifest architecture {arch!r} is not one of {ARCHITECTURES}; {REBUILD}")
    for key in ("max_len", "max_gamma", "default_gamma", "prefill_chunk"):
        if _require(m, key, int, "") < 1:
            raise BundleError(f"manifest {key}={m[key]} must be >= 1; {REBUILD}")
    if not 1 <= m["default_gamma"] <= m["max_gamma"]:
        raise BundleError(f"manifest default_gamma={m['default_gamma']} is outside "
                          f"[1, max_gamma={m['max_gamma']}]; {REBUILD}")
    if arch == "encoder-decoder":
        # the source is padded to max_source_len in the encoder graph; the decoder starts from
        # decoder_start_token_id
        if _require(m, "max_source_len", int, "") < 1:
            raise BundleError(f"manifest max_source_len={m['max_source_len']} must be >= 1; {REBUILD}")
        if _require(m, "decoder_start_token_id", int, "") < 0:
            raise BundleError(f"manifest decoder_start_token_id={m['decoder_start_token_id']} "
                              f"must be >= 0; {REBUILD}")
    files = _require(m, "files", dict, "")
    target = _require(m, "target", dict, "")
    _check_graphs(target, files, "target", GRAPHS[arch])
    if arch == "encoder-decoder" and m["decoder_start_token_id"] >= target["vocab_size"]:
        raise BundleError(f"manifest decoder_start_token_id={m['decoder_start_token_id']} is "
                          f"outside the target vocabulary ({target['vocab_size']}); {REBUILD}")
    draft = _require(m, "draft", dict, "")
    kind = _require(draft, "kind", str, "draft")
    if kind not in DRAFT_KINDS:
        raise BundleError(f"manifest draft.kind {kind!r} is not one of {DRAFT_KINDS}; {REBUILD}")
    if kind == "model":
        _check_graphs(draft, files, "draft", GRAPHS[arch])
    for where, entry in (("", m), ("target.", target), ("draft.", draft)):
        precision = entry.get("precision", "fp32")
        if precision not in PRECISIONS:
            raise BundleError(f"manifest {where}precision {precision!r} is not one this runtime "
                              f"runs {PRECISIONS}: upgrade specedge (`pip install -U specedge`), "
                              f"or rebuild with `specexport build --precision fp32`")
    tok = _require(m, "tokenizer", dict, "")
    if _require(tok, "file", str, "tokenizer") not in files:
        raise BundleError(f"manifest tokenizer.file {tok['file']!r} is not among the files; {REBUILD}")
    _require(tok, "eos_token_ids", list, "tokenizer")


def _check_graphs(model: dict, files: dict, where: str, required: tuple[str, ...]) -> None:
    graphs = _require(model, "graphs", dict, where)
    missing = [g for g in required if g not in graphs]
    if missing:
        raise BundleError(f"manifest {where}.graphs lacks {missing} (an architecture needs "
                          f"{list(required)}); {REBUILD}")
    for name, graph in graphs.items():
        f = _require(graph, "file", str, f"{where}.graphs.{name}")
        if f not in files:
            raise BundleError(f"manifest {where}.graphs.{name}.file {f!r} is not among the files; "
                              f"{REBUILD}")
        _require(graph, "inputs", list, f"{where}.graphs.{name}")
        _require(graph, "outputs", list, f"{where}.graphs.{name}")
        for key, allowed, default in (("kernels", KERNELS, "portable"),
                                      ("kv_cache", KV_CACHE_LAYOUTS, "new-slots")):
            value = graph.setdefault(key, default)  # schema 1 had neither: portable, new slots
            if value not in allowed:
                raise BundleError(f"manifest {where}.graphs.{name}.{key} {value!r} is not one "
                                  f"this runtime runs {allowed}: upgrade specedge (`pip install "
                                  f"-U specedge`), or {REBUILD}")
    _require(model, "vocab_size", int, where)


def check_file_hashes(bundle_dir: Path, manifest: dict) -> None:
    for name, info in manifest["files"].items():
        path = bundle_dir / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise BundleError(f"manifest lists file {name!r} outside the bundle; {REBUILD}")
        if not path.is_file():
            raise BundleError(f"bundle file {name!r} is missing from {str(bundle_dir)!r}; {REBUILD}")
        size = path.stat().st_size
        if size != info.get("bytes"):
            raise BundleError(f"bundle file {name!r} has {size} bytes, the manifest says "
                              f"{info.get('bytes')} (truncated or replaced); {REBUILD}")
        if sha256_file(path) != info.get("sha256"):
            raise BundleError(f"bundle file {name!r} does not match its sha256 in the manifest "
                              f"(corrupt or edited); {REBUILD}")
