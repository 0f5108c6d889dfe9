"""The checks `manifest.read_manifest` runs on a bundle before anything in it is used.

A bundle is untrusted input (it is copied between machines): every field the runtime uses is
type- and range-checked with the field named; each graph's description must be the graph
contract (contract.py) at the manifest's own max_len, vocabulary and cache layout; the files
themselves are files.py's. bundle.py then checks what ONNX Runtime reports of each graph
against the same description. Any failure is a BundleError.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

from .contract import (DTYPES, KERNELS, KV_CACHE_LAYOUTS, MAX_LANES, PRECISIONS, cache_dtype,
                       decoder_io, decoder_lanes_io, dims_of, encoder_io, hidden_size_of,
                       mismatch)
from ..errors import BundleError

REBUILD = "re-run `specexport build`"
ARCHITECTURES = ("decoder-only", "encoder-decoder")
# graphs every model entry (target, and a model draft) must hold, per architecture
GRAPHS = {"decoder-only": ("decoder",), "encoder-decoder": ("encoder", "decoder")}
# the batched decoder (contract.decoder_lanes_io) a decoder-only model may hold beside its
# fused decoder when the bundle's max_batch > 1
LANES_GRAPH = "decoder_lanes"
OPTIONAL_GRAPHS = {"decoder-only": (LANES_GRAPH,), "encoder-decoder": (LANES_GRAPH,)}
SCHEMA_1_DEFAULTS = {"kernels": "portable", "kv_cache": "new-slots"}  # what schema 1 graphs are
AUTO_SINCE = 3  # the first schema whose default_gamma may be "auto"
VOCAB_SINCE = 4  # the first schema whose draft may have a trimmed head (draft.vocab)
AUDIO_SINCE = 5  # the first schema with speech bundles (`audio`: an encoder of log-mel features)
BATCH_SINCE = 6  # the first schema with max_batch and lanes graphs
MAX_MELS = 512  # mel bins an audio encoder may read (Whisper has 80 or 128)
# what a speech bundle's timestamp rules read (manifest.AudioEntry.timestamps)
TIMESTAMP_KEYS = ("max_initial_timestamp_index", "prev_sot_token_id")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_NAME_BYTES = 255  # a file name, on every common file system
_TYPE_NAMES = {int: "an integer", str: "a string", dict: "an object", list: "a list"}


def depth(value, limit: int) -> int:
    """How deeply `value` (parsed JSON) nests lists and objects, counted up to `limit` + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _bad(where: str, value, want: str) -> BundleError:
    return BundleError(f"manifest {where} is {value!r}: {want}; {REBUILD}")


def _require(d: dict, key: str, types, where: str):
    if key not in d:
        raise BundleError(f"manifest {where + '.' if where else ''}{key} is missing: the bundle "
                          f"is incomplete; {REBUILD}")
    value = d[key]
    if not isinstance(value, types) or isinstance(value, bool) and types is not bool:
        kinds = types if isinstance(types, tuple) else (types,)
        names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in kinds)
        raise _bad(f"{where + '.' if where else ''}{key}", value, f"it must be {names}")
    return value


def _integer(d: dict, key: str, where: str, low: int, high: int | None = None,
             optional: bool = False) -> int | None:
    if optional and d.get(key) is None:
        return None
    value = _require(d, key, int, where)
    if value < low or high is not None and value > high:
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _bad(f"{where + '.' if where else ''}{key}", value, f"it must be an integer {span}")
    return value


def validate(m: dict) -> None:
    """Check every field the runtime uses; raises BundleError naming the field. Does not change
    `m`."""
    arch = _require(m, "architecture", str, "")
    if arch not in ARCHITECTURES:
        raise _bad("architecture", arch, f"it must be one of {ARCHITECTURES}")
    max_len = _integer(m, "max_len", "", 1)
    _integer(m, "max_gamma", "", 1, max_len - 1 if max_len > 1 else 1)
    if m.get("default_gamma") != "auto":
        _integer(m, "default_gamma", "", 1, m["max_gamma"])
    elif not isinstance(m.get("schema_version"), int) or m["schema_version"] < AUTO_SINCE:
        # an older writer never wrote "auto": such a manifest was edited, not built
        raise _bad("default_gamma", "auto", f"schema_version {m.get('schema_version')!r} "
                   f"predates it (\"auto\" is read since schema {AUTO_SINCE}); it must be an "
                   f"integer in [1, {m['max_gamma']}]")
    _integer(m, "prefill_chunk", "", 1)
    _precision(m, "")
    files = _require(m, "files", dict, "")
    for name, info in files.items():
        _check_file_entry(name, info)
    target = _require(m, "target", dict, "")
    max_source_len = None
    if arch == "encoder-decoder":
        # the source is padded to max_source_len in the encoder graph; the decoder starts from
        # decoder_start_token_id
        max_source_len = _integer(m, "max_source_len", "", 1)
    n_mels = _check_audio(m, arch, target)
    max_batch = _check_max_batch(m)
    _check_model(target, "target", m, files, max_source_len, n_mels, max_batch)
    if arch == "encoder-decoder":
        _integer(m, "decoder_start_token_id", "", 0, target["vocab_size"] - 1)
    draft = _require(m, "draft", dict, "")
    _require(draft, "kind", str, "draft")  # which kinds exist is the draft registry's business
    if "graphs" in draft:  # a draft with graphs of its own: a model entry like the target's
        _check_model(draft, "draft", m, files, max_source_len, n_mels, max_batch)
    _check_shared_encoder(m, draft)
    _check_draft_vocab(m, draft, files, target["vocab_size"])
    _check_tokenizer(_require(m, "tokenizer", dict, ""), files, target["vocab_size"])
    _check_distinct_graphs(m)
    _check_engines(m.get("engines"), files)
    _check_generation(m.get("generation"))
    _check_costs(m.get("costs"))


def _check_draft_vocab(m: dict, draft: dict, files: dict, target_vocab: int) -> None:
    """draft.vocab, a trimmed head's record: {file (its kept ids), size (the logits' width),
    embedding_rows (the ids the draft reads), chosen_by}; the ids themselves are checked where
    they are read (draft_vocab.read_kept_ids)."""
    if "vocab" not in draft:
        return
    vocab = draft["vocab"]
    if not isinstance(m.get("schema_version"), int) or m["schema_version"] < VOCAB_SINCE:
        raise _bad("draft.vocab", vocab, f"schema_version {m.get('schema_version')!r} predates "
                   f"it (a trimmed draft head is read since schema {VOCAB_SINCE})")
    if "graphs" not in draft or not isinstance(vocab, dict):
        raise _bad("draft.vocab", vocab, "it must be an object, on a draft with graphs")
    f = _require(vocab, "file", str, "draft.vocab")
    if f not in files:
        raise BundleError(f"manifest draft.vocab.file {f!r} is not among the files; {REBUILD}")
    size = _integer(vocab, "size", "draft.vocab", 1, target_vocab)
    if size != draft["vocab_size"]:
        raise _bad("draft.vocab.size", size, f"it must be the draft's vocab_size "
                   f"{draft['vocab_size']} (its logits' width)")
    _integer(vocab, "embedding_rows", "draft.vocab", size)
    if not isinstance(vocab.get("chosen_by", ""), str):
        raise _bad("draft.vocab.chosen_by", vocab["chosen_by"], "it must be a string")


def _check_max_batch(m: dict) -> int:
    """max_batch (schema 6): an integer in [1, MAX_LANES], 1 where absent (every older bundle);
    more than 1 only in a schema that has it."""
    if "max_batch" not in m:
        return 1
    max_batch = _integer(m, "max_batch", "", 1, MAX_LANES)
    version = m.get("schema_version")
    if max_batch > 1 and (not isinstance(version, int) or version < BATCH_SINCE):
        raise _bad("max_batch", max_batch, f"schema_version {version!r} predates it (lanes "
                   f"graphs are read since schema {BATCH_SINCE})")
    return max_batch


# auto γ's prices measured at build (stats.Costs): each key's largest sensible value
COSTS = {"draft_step": 10.0, "verify_row": 1.0}


def _check_costs(costs) -> None:
    """Auto γ's prices, in target steps: both keys, finite numbers in [0, their bound]."""
    if costs is None:
        return
    if not isinstance(costs, dict) or set(costs) != set(COSTS):
        raise _bad("costs", costs, f"it must be an object of {list(COSTS)}")
    for key, most in COSTS.items():
        value = costs[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value <= most:  # NaN fails this too
            raise _bad(f"costs.{key}", value, f"it must be a number in [0, {most:g}]")


def _check_generation(generation) -> None:
    """The model's sampling defaults: an object whose keys are names; which names and values
    SamplingParams takes is checked where the model is put together (loading.py), the layer
    that knows SamplingParams."""
    if generation is None:
        return
    if not isinstance(generation, dict):
        raise _bad("generation", generation, "it must be an object")


def _check_engines(engines, files: dict) -> None:
    if engines is None:
        return
    if not isinstance(engines, dict):
        raise _bad("engines", engines, "it must be an object")
    for kind, record in engines.items():
        where = f"engines.{kind}"
        if not isinstance(record, dict):
            raise _bad(where, record, "it must be an object")
        for key in ("tensorrt_version", "gpu", "compute_capability"):
            _require(record, key, str, where)
        for graph, f in _require(record, "graphs", dict, where).items():
            if not isinstance(f, str) or f not in files:
                raise BundleError(f"manifest {where}.graphs[{graph!r}] {f!r} is not among the "
                                  f"files; {REBUILD}")


def _precision(entry: dict, where: str) -> None:
    precision = entry.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise BundleError(f"manifest {where}precision {precision!r} is not one this runtime "
                          f"runs {PRECISIONS}: upgrade draftproof (`pip install -U draftproof`), "
                          f"or rebuild with `specexport build --precision fp32`")


def _check_file_entry(name: str, info) -> None:
    # a bundle is flat: every file is a plain name inside the bundle directory
    if not name or name in (".", "..") or name != os.path.basename(name) or "\\" in name \
            or "\0" in name:
        raise BundleError(f"manifest lists the file {name!r}, which is not a plain file name "
                          f"inside the bundle; {REBUILD}")
    if len(name.encode("utf-8", errors="surrogatepass")) > MAX_NAME_BYTES:
        raise BundleError(f"manifest lists a file whose name has more than {MAX_NAME_BYTES} "
                          f"bytes ({name[:40]!r}...), longer than file systems allow; {REBUILD}")
    if not isinstance(info, dict):
        raise _bad(f"files[{name!r}]", info, "it must hold bytes and sha256")
    _integer(info, "bytes", f"files[{name!r}]", 0)
    sha = _require(info, "sha256", str, f"files[{name!r}]")
    if not _SHA256.match(sha):
        raise _bad(f"files[{name!r}].sha256", sha, "it must be 64 lowercase hex digits")


def _check_audio(m: dict, arch: str, target: dict) -> int | None:
    """`audio`, a speech bundle's record (manifest.AudioEntry): its mel bins, and the prompt
    and suppressed token ids, each inside the target's vocabulary. Returns n_mels, or None for a
    bundle of text."""
    audio = m.get("audio")
    if audio is None:
        return None
    if arch != "encoder-decoder":
        raise _bad("audio", "(present)", f"a speech bundle is encoder-decoder, not {arch}")
    version = m.get("schema_version")
    if not isinstance(version, int) or version < AUDIO_SINCE:
        raise _bad("schema_version", version, f"a bundle with `audio` is schema {AUDIO_SINCE} "
                   f"or later")
    if not isinstance(audio, dict):
        raise _bad("audio", audio, "it must be an object")
    n_mels = _integer(audio, "n_mels", "audio", 1, MAX_MELS)
    vocab = _integer(target, "vocab_size", "target", 1)
    for key in ("languages", "tasks"):
        table = _require(audio, key, dict, "audio")
        for name, token in table.items():
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise _bad(f"audio.{key}[{name!r}]", token,
                           f"it must be a token id in [0, {vocab})")
    # English-only Whispers have no task tokens; the others' every prompt holds <|transcribe|>
    # (translate is asked for, and refused when missing, by the request)
    tasks = audio["tasks"]
    if tasks and "transcribe" not in tasks:
        raise _bad("audio.tasks", tasks, "a model with task tokens must have 'transcribe' "
                   "(an English-only model has none: {})")
    _integer(audio, "no_timestamps_token_id", "audio", 0, vocab - 1, optional=True)
    for key in ("suppress_tokens", "begin_suppress_tokens"):
        ids = _require(audio, key, list, "audio")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < vocab]
        if bad:
            raise _bad(f"audio.{key}", bad[0], f"each must be a token id in [0, {vocab})")
    stamps = audio.get("timestamps")
    if stamps is not None:
        no_ts = audio.get("no_timestamps_token_id")
        if no_ts is None or no_ts + 1 >= vocab:
            raise _bad("audio.timestamps", "(present)", "timestamp tokens are the ids after "
                       "no_timestamps_token_id, inside the vocabulary")
        if not isinstance(stamps, dict) or set(stamps) != set(TIMESTAMP_KEYS):
            raise _bad("audio.timestamps", stamps, f"it must be an object of "
                       f"{', '.join(TIMESTAMP_KEYS)}")
        _integer(stamps, "max_initial_timestamp_index", "audio.timestamps", 0,
                 vocab - no_ts - 2, optional=True)
        _integer(stamps, "prev_sot_token_id", "audio.timestamps", 0, vocab - 1, optional=True)
    return n_mels


def _shares_encoder(model: dict, where: str) -> bool:
    return where == "draft" and model.get("shared_encoder") is True


def _check_shared_encoder(m: dict, draft: dict) -> None:
    """draft.shared_encoder (schema 5): the draft has a decoder only, which reads the target's
    cross-attention K/V, so its cross inputs must be the target decoder's, name for name."""
    if "shared_encoder" not in draft:
        return
    shared = draft["shared_encoder"]
    if shared is not True or m["architecture"] != "encoder-decoder" or "graphs" not in draft:
        raise _bad("draft.shared_encoder", shared, "it is true, on an encoder-decoder's draft "
                   "with a decoder of its own, or absent")
    if not isinstance(m.get("schema_version"), int) or m["schema_version"] < AUDIO_SINCE:
        raise _bad("draft.shared_encoder", shared, f"schema_version "
                   f"{m.get('schema_version')!r} predates it (read since schema {AUDIO_SINCE})")

    def cross(model):
        return [i for i in model["graphs"]["decoder"]["inputs"]
                if str(i.get("name", "")).startswith("cross_")]

    if cross(draft) != cross(m["target"]):
        raise BundleError(f"manifest draft.shared_encoder: the draft decoder's cross inputs are "
                          f"not the target decoder's, so it cannot read the target's encoder "
                          f"output; {REBUILD}")


def _check_model(model: dict, where: str, m: dict, files: dict, max_source_len,
                 n_mels: int | None = None, max_batch: int = 1) -> None:
    vocab = _integer(model, "vocab_size", where, 1)
    _precision(model, where + ".")
    graphs = _require(model, "graphs", dict, where)
    shared = _shares_encoder(model, where)
    required = ("decoder",) if shared else GRAPHS[m["architecture"]]
    missing = [g for g in required if g not in graphs]
    if missing:
        raise BundleError(f"manifest {where}.graphs lacks {missing} (an architecture needs "
                          f"{list(required)}); {REBUILD}")
    known = required + OPTIONAL_GRAPHS[m["architecture"]]
    unknown = [g for g in graphs if g not in known]
    if unknown:
        raise BundleError(f"manifest {where}.graphs has {unknown}, not a graph of a "
                          f"{m['architecture']} model ({list(known)}): upgrade draftproof "
                          f"(`pip install -U draftproof`), or {REBUILD}")
    described = {}
    for name in [g for g in known if g in graphs]:
        graph = _require(graphs, name, dict, f"{where}.graphs")
        at = f"{where}.graphs.{name}"
        f = _require(graph, "file", str, at)
        if f not in files:
            raise BundleError(f"manifest {at}.file {f!r} is not among the files; {REBUILD}")
        for key, allowed in (("kernels", KERNELS), ("kv_cache", KV_CACHE_LAYOUTS)):
            value = graph.get(key, SCHEMA_1_DEFAULTS[key])
            if value not in allowed:
                raise BundleError(f"manifest {at}.{key} {value!r} is not one this runtime runs "
                                  f"{allowed}: upgrade draftproof (`pip install -U "
                                  f"draftproof`), or {REBUILD}")
        devices = graph.get("devices")
        if devices is not None and not (isinstance(devices, list) and devices
                                        and all(isinstance(d, str) for d in devices)):
            raise _bad(f"{at}.devices", devices, "it must be a list of device names")
        described[name] = (_io_list(graph, "inputs", at), _io_list(graph, "outputs", at))
    # the descriptions must be the contract at this manifest's own numbers
    dec = described["decoder"]
    dims = dims_of(*dec)
    if dims is None:
        raise BundleError(f"manifest {where}.graphs.decoder has no past_key.0 input of shape "
                          f"[1, kv_heads, cache, head_dim] or no logits output; {REBUILD}")
    kv_cache = graphs["decoder"].get("kv_cache", SCHEMA_1_DEFAULTS["kv_cache"])
    dtype = cache_dtype(model.get("precision", "fp32"))
    wants = {"decoder": decoder_io(replace(dims, vocab_size=vocab), m["max_len"], kv_cache,
                                   max_source_len, hidden_size_of(dec[1]), dtype,
                                   audio=n_mels is not None)}
    if max_source_len is not None and not shared:
        wants["encoder"] = encoder_io(dims, max_source_len, dtype, n_mels)
    if _check_lanes(model, where, graphs, kv_cache, max_batch, max_source_len is not None):
        wants[LANES_GRAPH] = decoder_lanes_io(replace(dims, vocab_size=vocab), m["max_len"],
                                              max_batch, dtype, kv_cache, max_source_len,
                                              audio=n_mels is not None)
    for name, want in wants.items():
        why = mismatch(described[name], want)
        if why:
            numbers = (f"max_len {m['max_len']}, {where}.vocab_size {vocab}, kv_cache "
                       f"{kv_cache}, precision {model.get('precision', 'fp32')}")
            if max_source_len is not None:
                numbers += f", max_source_len {max_source_len}"
            if name == LANES_GRAPH:
                numbers += f", max_batch {max_batch}"
            raise BundleError(f"manifest {where}.graphs.{name} does not fit the manifest's own "
                              f"numbers ({numbers}): {why}; {REBUILD}")


def _check_lanes(model: dict, where: str, graphs: dict, kv_cache: str, max_batch: int,
                 encdec: bool) -> bool:
    """Whether `model` holds a lanes graph, and that it may: only with max_batch > 1, in the
    kernels and cache layout of the decoder graph it batches: a fused, in-place decoder's, or
    an encoder-decoder's portable one (new slots); the target always has one when max_batch >
    1 (a draft may have none: a portable decoder-only draft, or a quantized encoder-decoder
    draft, whose steps are not batched). Its description is compared with the contract by the
    caller."""
    at = f"{where}.graphs.{LANES_GRAPH}"
    if LANES_GRAPH not in graphs:
        if where == "target" and max_batch > 1:
            raise BundleError(f"manifest max_batch is {max_batch}, and target.graphs has no "
                              f"{LANES_GRAPH} (the target's batched graph); {REBUILD}")
        return False
    if max_batch == 1:
        raise BundleError(f"manifest {at} is present, and max_batch is 1 (a lanes graph batches "
                          f"max_batch > 1 sequences); {REBUILD}")
    lanes = graphs[LANES_GRAPH]
    kernels = graphs["decoder"].get("kernels", SCHEMA_1_DEFAULTS["kernels"])
    kernels_want, cache_want = ("portable", "new-slots") if encdec else ("fused", "in-place")
    kind = "an encoder-decoder" if encdec else "a decoder-only model"
    for field, value, want in ((f"{at}.kernels", lanes.get("kernels"), kernels_want),
                               (f"{at}.kv_cache", lanes.get("kv_cache"), cache_want),
                               (f"{where}.graphs.decoder.kernels", kernels, kernels_want),
                               (f"{where}.graphs.decoder.kv_cache", kv_cache, cache_want)):
        if value != want:
            raise _bad(field, value, f"a lanes graph and the decoder it batches are {want} "
                                     f"for {kind}")
    return True


def _io_list(graph: dict, key: str, where: str) -> list[dict]:
    items = _require(graph, key, list, where)
    for i, item in enumerate(items):
        at = f"{where}.{key}[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, item, "it must be a {name, dtype, shape} object")
        _require(item, "name", str, at)
        if _require(item, "dtype", str, at) not in DTYPES:
            raise _bad(f"{at}.dtype", item["dtype"], f"it must be one of {tuple(DTYPES)}")
        for d in _require(item, "shape", list, at):
            if not (isinstance(d, str) or isinstance(d, int) and not isinstance(d, bool)
                    and d >= 1):
                raise _bad(f"{at}.shape", item["shape"], "its dims must be integers >= 1 or "
                           "names of symbolic dims")
    return items


def _check_tokenizer(tok: dict, files: dict, vocab: int) -> None:
    f = _require(tok, "file", str, "tokenizer")
    if f not in files:
        raise BundleError(f"manifest tokenizer.file {f!r} is not among the files; {REBUILD}")
    eos = _require(tok, "eos_token_ids", list, "tokenizer")
    if not eos or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                          for i in eos):
        raise _bad("tokenizer.eos_token_ids", eos, f"it must be a non-empty list of token ids "
                   f"in [0, {vocab})")
    _integer(tok, "bos_token_id", "tokenizer", 0, vocab - 1, optional=True)
    special = tok.get("special_tokens")
    if special is not None and not (isinstance(special, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in special.items())):
        raise _bad("tokenizer.special_tokens", special, "it must map names to token strings")
    template = tok.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise _bad("tokenizer.chat_template", template, "it must be a string or null")
    digest = tok.get("vocab_sha256")
    if digest is not None and not (isinstance(digest, str) and _SHA256.match(digest)):
        raise _bad("tokenizer.vocab_sha256", digest, "it must be 64 lowercase hex digits")


def _check_distinct_graphs(m: dict) -> None:
    """No file serves as two graphs: a draft that is the target's own file is a copy mistake,
    not a draft (a self draft is the target's weights at another precision, another file)."""
    seen: dict[str, str] = {}
    for role, model in (("target", m["target"]), ("draft", m["draft"])):
        for name, graph in (model.get("graphs") or {}).items():
            where = f"{role}.graphs.{name}"
            if graph["file"] in seen:
                raise BundleError(f"manifest {where}.file and {seen[graph['file']]}.file are "
                                  f"the same file {graph['file']!r}; {REBUILD}")
            seen[graph["file"]] = where


