"""`specexport verify`: re-check a built bundle against the models it came from.

Every file's sha256 (and everything `spec_runtime.load` checks of the manifest), then every
graph against its PyTorch model, loaded again from the source the manifest records:
- a float32 graph: max |logits - PyTorch's| over prefill, steps, verify calls and a rollback
  (check.check_parity) within FP32_TOLERANCE;
- a quantized decoder graph: top-1 agreement and mean KL with the float model over
  QUANT_PROMPTS, against the thresholds the build recorded from its own measurement (older
  bundles: only the "broken" rule the build applies);
- an int8 encoder-decoder graph: max |diff| within the recorded limit.
A graph that fails raises BundleError: the bundle does not hold the model it says it does.
`format_report` turns the report into the table `specexport verify` prints.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from spec_runtime.bundle.reader import default_bundle_dir
from spec_runtime.errors import BundleError
from spec_runtime.bundle.manifest import Manifest, ModelEntry, read_manifest

from .quality import (FP32_MAX_RELATIVE, FP32_RELATIVE, FP32_TOLERANCE, MAX_BROKEN_KL,
                      MIN_TOP1_AGREEMENT, broken_quantization, check_inputs, fp32_tolerance)
from ..sources.source import ModelSpec, load_model


def verify_bundle(bundle_dir=None) -> dict:
    bundle_dir = Path(bundle_dir) if bundle_dir else default_bundle_dir()
    manifest = read_manifest(bundle_dir, check_files=True)
    report = {"bundle": str(bundle_dir), "files": "ok", "graphs": {}}
    t_model, t_tok = load_model(ModelSpec(manifest.target.source, manifest.target.gguf_file))
    ids, quant_ids, _ = check_inputs(t_tok, t_model.config.vocab_size)
    for role, entry in manifest.models():
        model = t_model if role == "target" else \
            load_model(ModelSpec(entry.source, entry.gguf_file))[0]
        if role == "draft" and "vocab" in manifest.draft.options:
            _trim_head(model, bundle_dir, manifest)
        for graph, (diff, limit) in _parity(model, bundle_dir, entry, manifest, ids).items():
            row = {"precision": entry.precision, "max_abs_diff": diff}
            report["graphs"][f"{role}/{graph}"] = row
            if entry.precision == "fp32":
                if limit is None:
                    limit = fp32_tolerance(_logit_scale(model, ids))
                row.update(limit=limit, ok=diff <= limit)
            elif manifest.encoder_decoder:
                limit = (entry.parity or {}).get("verify_max_abs_diff_int8")
                row.update(limit=limit, ok=limit is None or diff <= limit)
            if row.get("ok") is False:
                raise BundleError(f"{role} {graph} graph differs from its PyTorch model by "
                                  f"{diff:.3g} > {row['limit']:.3g}: it is not the model the "
                                  f"manifest names; re-run `specexport build`")
        if entry.precision != "fp32" and not manifest.encoder_decoder:
            _check_quantized(report["graphs"][f"{role}/decoder"], role, entry, model, bundle_dir,
                             quant_ids)
    return report


def _trim_head(model, bundle_dir: Path, manifest: Manifest) -> None:
    """The PyTorch draft's output head cut to the kept ids of its trimmed graph (the bundle's
    draft.vocab), so that their logits compare id for id; its input embedding stays whole."""
    from spec_runtime.decode.draft_vocab import read_kept_ids

    from .calls import trim_output_head

    kept = read_kept_ids(bundle_dir, manifest.draft.options["vocab"], manifest.target.vocab_size,
                         manifest.tokenizer.eos_token_ids)
    trim_output_head(model, kept.ids)


def _check_quantized(row: dict, role: str, entry: ModelEntry, model, bundle_dir: Path,
                     prompts) -> None:
    """A quantized graph's logits differ from the float model's by design; it is judged by how
    often it picks the same next token and how far its distribution moves (KL)."""
    from .quantized import quantized_parity

    measured = quantized_parity(model, bundle_dir / entry.graphs["decoder"].file, prompts)
    limits = ((entry.parity or {}).get(entry.precision) or {}).get("verify_thresholds")
    row.update(measured, thresholds=limits)
    if limits is None:
        row["ok"] = not broken_quantization(measured)
    else:
        row["ok"] = (measured["top1_agreement"] >= limits["min_top1_agreement"]
                     and measured["mean_kl"] <= limits["max_mean_kl"])
    if not row["ok"]:
        want = (f"the build measured it within top-1 >= {limits['min_top1_agreement']:.2f}, "
                f"KL <= {limits['max_mean_kl']:.3f}" if limits else "a working graph agrees far "
                "more")
        raise BundleError(f"{role} {entry.precision} graph agrees with the float model on "
                          f"{measured['top1_agreement']:.0%} of next tokens (mean KL "
                          f"{measured['mean_kl']:.3f}), and {want}: its weights are not the "
                          f"model's; re-run `specexport build`")


def _logit_scale(model, ids) -> float:
    """The largest |logit| PyTorch gives over the parity prompt: what float32 rounding scales
    with (quality.fp32_tolerance)."""
    import torch

    with torch.no_grad():
        return float(model(torch.tensor([list(ids)])).logits.abs().max())


def _parity(model, bundle_dir: Path, entry: ModelEntry, manifest: Manifest,
            ids) -> dict[str, tuple[float, float | None]]:
    """{graph name: (max |diff|, its float32 tolerance where the measurement gives it)} for one
    model's graphs."""
    from .check import check_parity, fp32_parity_seq2seq

    encoder, prompt, shared = {}, ids, False
    if manifest.encoder_decoder:
        from ..bundle.build_seq2seq import parity_inputs

        source, prompt = parity_inputs(model, ids, manifest.max_source_len)
        # a draft that shares the encoder (draft.shared_encoder: a self draft under a float32
        # target) runs over the target's encoder graph, already checked as the target's
        shared = "encoder" not in entry.graphs
        graph = (manifest.target if shared else entry).graphs["encoder"]
        encoder = dict(encoder_path=bundle_dir / graph.file, source=source)
    decoder = bundle_dir / entry.graphs["decoder"].file
    if encoder and entry.precision == "fp32":  # the build's rule (scale, the model's rounding)
        diffs = fp32_parity_seq2seq(model, decoder, prompt, **encoder)
    else:
        diffs = {g: (d, None) for g, d in check_parity(model, decoder, prompt, **encoder).items()}
    return {g: d for g, d in diffs.items() if not (shared and g == "encoder")}


# -- the table `specexport verify` prints ---------------------------------------------------------

DIFF_CHECK = "max |Δlogit| vs PyTorch"
TOP1_CHECK = "top-1 agreement vs float model"
KL_CHECK = "mean KL vs float model"
COLUMNS = ("role", "graph", "precision", "check", "measured", "threshold", "result")


def _ok(flag: bool) -> str:
    return "ok" if flag else "FAIL"


def report_rows(report: dict) -> list[dict]:
    """One row per graph and check of a verify_bundle report, as strings: role, graph,
    precision, check (what was compared with what), measured, threshold, result ("ok", "FAIL",
    or "info" for a value shown but not judged)."""
    rows = []
    for key, g in report["graphs"].items():
        role, graph = key.split("/", 1)
        base = {"role": role, "graph": graph, "precision": g["precision"]}
        diff = f"{g['max_abs_diff']:.3g}"
        if "top1_agreement" in g:  # a quantized decoder graph: judged against the float model
            limits = g.get("thresholds")
            if limits:
                top1_limit = f">= {limits['min_top1_agreement']:.1%}"
                kl_limit = f"<= {limits['max_mean_kl']:.3g}"
                top1_ok = g["top1_agreement"] >= limits["min_top1_agreement"]
                kl_ok = g["mean_kl"] <= limits["max_mean_kl"]
            else:  # a bundle built before thresholds were recorded: only the "broken" rule
                top1_limit = f">= {MIN_TOP1_AGREEMENT:.0%} or KL <= {MAX_BROKEN_KL}"
                kl_limit = f"<= {MAX_BROKEN_KL} or top-1 >= {MIN_TOP1_AGREEMENT:.0%}"
                top1_ok = kl_ok = g["ok"]
            rows += [dict(base, check=TOP1_CHECK, measured=f"{g['top1_agreement']:.1%}",
                          threshold=top1_limit, result=_ok(top1_ok)),
                     dict(base, check=KL_CHECK, measured=f"{g['mean_kl']:.3g}",
                          threshold=kl_limit, result=_ok(kl_ok)),
                     dict(base, check=DIFF_CHECK, measured=diff, threshold="not judged",
                          result="info")]
        else:  # fp32, or an int8 encoder-decoder graph with the limit its build recorded
            limit = g.get("limit")
            rows.append(dict(base, check=DIFF_CHECK, measured=diff,
                             threshold="not recorded" if limit is None else f"<= {limit:.3g}",
                             result=_ok(g.get("ok", True))))
    return rows


def format_report(report: dict) -> str:
    """The report as a table, one row per graph and check, then what the checks mean."""
    rows = report_rows(report)
    header = dict(zip(COLUMNS, COLUMNS))
    widths = {c: max(len(r[c]) for r in [header, *rows]) for c in COLUMNS}

    def line(r: dict) -> str:
        return "  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip()

    failed = sum(r["result"] == "FAIL" for r in rows)
    judged = sum(r["result"] != "info" for r in rows)
    files = ("every file's size and sha256 match the manifest" if report["files"] == "ok"
             else report["files"])
    int8_encdec = any(r["precision"] != "fp32" and r["check"] == DIFF_CHECK
                      and r["result"] != "info" for r in rows)
    notes = [f"Float (fp32) graphs are judged by max |Δlogit| against the PyTorch model they "
             f"came from (<= {FP32_TOLERANCE:g}, or {FP32_RELATIVE:g} of its largest logit "
             f"when that is more; an encoder-decoder's more where the model's own float32 "
             f"rounding is, up to {FP32_MAX_RELATIVE:g} of its values); quantized graphs (int4, "
             f"int8, fp16) by top-1 agreement and mean KL against the float model, within the "
             f"thresholds recorded at build"
             + ("; int8 encoder-decoder graphs by max |Δlogit| within the limit recorded at "
                "build." if int8_encdec else ".")]
    shown = [r for r in rows if r["result"] == "info"]
    if shown:
        where = ", ".join(f"{r['measured']} on the {r['role']} {r['graph']}" for r in shown)
        notes.append(f"A quantized graph's max |Δlogit| is its expected rounding error, shown "
                     f"for information and not a failure ({where}).")
    out = [f"bundle {report['bundle']}", f"files: {files}", "", line(header), *map(line, rows),
           "", f"{judged - failed} of {judged} checks passed"
           + (f", {failed} FAILED" if failed else "")]
    return "\n".join(out + [textwrap.fill(n, 100) for n in notes])
