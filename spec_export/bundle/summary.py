"""What `specexport build` prints when it is done: a few lines describing the bundle, read back
from the manifest it wrote (so the summary is always what was written, never what was asked)."""

from __future__ import annotations

from pathlib import Path

from spec_runtime.bundle.manifest import MANIFEST, Manifest, ModelEntry, read_manifest

from ..parity.quality import WARN_TOP1_AGREEMENT


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 50_000 else f"{n_bytes / 1e6:.2f} MB"


def _model_bytes(manifest: Manifest, entry: ModelEntry) -> int:
    """The model's graph files with their external weights (`<graph>.data`)."""
    names = {g.file for g in entry.graphs.values()}
    names |= {n + ".data" for n in names}
    return sum(f.bytes for n, f in manifest.files.items() if n in names)


def _source(entry: ModelEntry) -> str:
    if entry.gguf_file:
        return f"{entry.source.rstrip('/')}/{entry.gguf_file}"
    return str(entry.source)


def _parity(role: str, entry: ModelEntry, encoder_decoder: bool) -> str:
    """What the build measured for one model against PyTorch (and, quantized, against the
    float model)."""
    p = entry.parity or {}
    parts = []
    if "max_abs_diff_fp32" in p:
        what = "max |Δlogit|" if entry.precision == "fp32" else "fp32 export max |Δlogit|"
        parts.append(f"{what} {p['max_abs_diff_fp32']:.2g} (tolerance "
                     f"{p.get('tolerance_fp32', 0):.2g})")
    q = p.get(entry.precision) if entry.precision != "fp32" else None
    if isinstance(q, dict) and "top1_agreement" in q:
        parts.append(f"top-1 {q['top1_agreement']:.1%}, mean KL {q['mean_kl']:.3g} vs the float "
                     f"model")
    if encoder_decoder and "max_abs_diff_int8" in p:
        parts.append(f"int8 max |Δlogit| {p['max_abs_diff_int8']:.2g}")
    if isinstance(q, dict):
        follows, of = q.get("follows_float"), q.get("follow_tokens")
        if isinstance(follows, list) and isinstance(of, list) and follows \
                and len(follows) == len(of):
            parts.append("greedy output follows the float model's for "
                         + ", ".join(f"{n}/{m}" for n, m in zip(follows, of))
                         + " tokens")
    return f"{role} {entry.precision}: " + ("; ".join(parts) or "not recorded")


def _low_agreement(role: str, entry: ModelEntry) -> str | None:
    """A warning for a quantized graph that agrees with the float model on too few next
    tokens to stand for it (quality.WARN_TOP1_AGREEMENT), with what keeps closer."""
    q = (entry.parity or {}).get(entry.precision)
    if entry.precision == "fp32" or not isinstance(q, dict) \
            or q.get("top1_agreement", 1.0) >= WARN_TOP1_AGREEMENT:
        return None
    closer = ("--int4-weights gguf (the file's own blocks), " if entry.gguf_file
              and entry.precision == "int4" else "")
    effect = ("its output leaves the float model's within a few tokens" if role == "target"
              else "fewer of its tokens will be accepted")
    return (f"the {role}'s {entry.precision} graph agrees with the float model on "
            f"{q['top1_agreement']:.0%} of next tokens (below {WARN_TOP1_AGREEMENT:.0%}): "
            f"{effect}; {closer}a smaller --block-size, --precision int8 or fp32 keep closer")


def _draft(manifest: Manifest) -> str:
    d = manifest.draft
    o = d.options
    if d.kind == "ngram":
        what = (f"prompt lookup (matches of {o.get('min_ngram', 1)} to {o.get('max_ngram', 3)} "
                f"tokens), no graph")
    elif d.model is not None:
        m = d.model
        own = m.source == manifest.target.source and m.gguf_file == manifest.target.gguf_file
        what = (f"the target's own weights at {m.precision}" if own
                else f"{m.family or 'model'} from {_source(m)}, {m.precision}")
        what += f", {_mb(_model_bytes(manifest, m))}"
        if o.get("vocab"):  # a trimmed head: a step reads its kept rows only
            v = o["vocab"]
            what += (f", head trimmed to {v['size']} of {v['embedding_rows']} ids "
                     f"({v['size'] / v['embedding_rows']:.0%} of its rows; by {v['chosen_by']})")
        if d.kind == "hybrid":
            what += ", + prompt lookup"
    else:
        what = ""
    auto = f" (auto: {o['auto_reason']})" if o.get("auto_reason") else ""
    return f"{d.kind}{auto}" + (f": {what}" if what else "")


def _batching(manifest: Manifest) -> str:
    """What `--max-batch` made: each model's lanes graph and how far its lanes were from its
    decoder graph on this machine (lanes_parity.py), or why a draft has none."""
    parts = []
    for role, entry in manifest.models():
        lanes = (entry.parity or {}).get("lanes")
        if "decoder_lanes" in entry.graphs and isinstance(lanes, dict) \
                and "max_abs_diff" in lanes:
            parts.append(f"{role} lanes graph, max |Δlogit| vs its decoder graph "
                         f"{lanes['max_abs_diff']:.2g} (tolerance {lanes.get('tolerance', 0):.2g})")
        elif isinstance(lanes, dict) and lanes.get("none"):
            parts.append(f"{role}: {lanes['none']}")
        else:
            parts.append(f"{role}: no lanes graph")
    if manifest.draft.model is None:
        parts.append(f"draft: {manifest.draft.kind}, no graph to batch")
    return f"max_batch {manifest.max_batch}: " + "; ".join(parts)


def _gb(mb) -> str:
    return "?" if mb is None else f"{mb / 1e3:.1f} GB"


def _build(record: dict) -> str:
    """Time and peak memory of the build and of each stage (peak: the process's, so far)."""
    stages = ", ".join(f"{s['stage']} {s['seconds']:.0f} s ({_gb(s.get('peak_rss_mb'))})"
                       for s in record["stages"])
    return (f"{record.get('seconds', 0):.0f} s, peak memory {_gb(record.get('peak_rss_mb'))}: "
            f"{stages}")


def build_summary(bundle_dir) -> str:
    """A few lines on the bundle at `bundle_dir`: target, draft (and why, when `--draft auto`
    chose it), parity, cache and γ, total size and path."""
    bundle_dir = Path(bundle_dir)
    m = read_manifest(bundle_dir, check_files=False)  # just written and hashed
    t = m.target
    total = sum(f.bytes for f in m.files.values()) + (bundle_dir / MANIFEST).stat().st_size
    target = f"{t.family or 'model'}, {t.precision}, {_mb(_model_bytes(m, t))}, from {_source(t)}"
    rows = [("target", target),
            ("draft", _draft(m))]
    rows += [("parity", _parity(role, e, m.encoder_decoder)) for role, e in m.models()]
    if (t.parity or {}).get("inputs"):  # the text could not be tokenized: what parity ran on
        rows.append(("note", t.parity["inputs"]))
    cache = f"max_len {m.max_len}, γ {m.default_gamma} (up to {m.max_gamma}), prefill chunk " \
            f"{m.prefill_chunk}"
    if m.encoder_decoder:
        cache += f", max_source_len {m.max_source_len}"
    rows.append(("cache", cache))
    if m.max_batch > 1:
        rows.append(("batching", _batching(m)))
    if m.costs:  # what auto γ prices a seeded sample's rounds at
        rows.append(("costs", f"auto γ's prices: a draft step {m.costs['draft_step']:.3g}, a "
                              f"verified row past the first {m.costs['verify_row']:.3g} target "
                              f"steps (measured on this machine)"))
    rows.append(("size", f"{_mb(total)} in {len(m.files) + 1} files"))
    rows += [("warning", w) for w in (_low_agreement(role, e) for role, e in m.models()) if w]
    build = m.created_by.get("build") if isinstance(m.created_by, dict) else None
    if isinstance(build, dict) and build.get("stages"):
        rows.append(("build", _build(build)))
    width = max(len(k) for k, _ in rows)
    return "\n".join([*(f"{k.ljust(width)}  {v}" for k, v in rows),
                      f"bundle written to {bundle_dir}"])
