"""The report of benchmarks/compare.py: which rows its table has, the speed targets it checks,
how far each system's greedy output follows the float model's (float_agreement, which the pair
race's report, pair_report.py, reads too), and the markdown table and result files made from a
run's report dict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import reports

SYSTEMS = ("draftproof", "draftproof-spec", "hf", "hf-lookup", "ortgenai", "ortgenai-ngram",
           "llamacpp", "llamacpp-lookup", "openvino", "openvino-lookup", "openvino-draft")
REFERENCE = "hf"
# without hf (int4), each speculative mode is compared with its own plain mode: exactness is
# relative to the deployed target
PLAIN_OF = {"draftproof-spec": "draftproof", "ortgenai-ngram": "ortgenai",
            "llamacpp-lookup": "llamacpp", "hf-lookup": "hf", "openvino-lookup": "openvino",
            "openvino-draft": "openvino"}
# speed targets: (ours, peer, wanted ratio) per precision; the fp32 one against every peer
# mode at true f32, the int4 one against OpenVINO's int4 with prompt lookup (first step 1.0×,
# the goal 1.3×)
TARGETS = {"fp32": [("draftproof-spec", peer, 1.5) for peer in
                    ("ortgenai-ngram", "openvino", "openvino-lookup", "openvino-draft")],
           "int4": [("draftproof-spec", "openvino-lookup", 1.0),
                    ("draftproof-spec", "openvino", 1.0),
                    ("draftproof-spec", "ortgenai-ngram", 1.3),
                    ("draftproof-spec", "llamacpp", 1.5)]}


def title(report: dict) -> str:
    cfg = report["config"]
    return f"draftproof vs peers — {cfg['precision']}, greedy, {cfg['max_new_tokens']} new tokens"


def markdown(report: dict) -> str:
    return f"# {title(report)}\n\n{body(report)}"


# the rows' names in runs stored before the project was renamed
OLD_NAMES = {"specedge": "draftproof", "specedge-spec": "draftproof-spec"}


def current_names(report):
    """`report` with our rows (and our package among the versions) under their current names:
    a run stored before the rename keys them "specedge" and "specedge-spec"."""
    if isinstance(report, dict):
        return {OLD_NAMES.get(k, k): current_names(v) for k, v in report.items()}
    if isinstance(report, list):
        return [current_names(v) for v in report]
    return OLD_NAMES.get(report, report) if isinstance(report, str) else report


def body(report: dict) -> str:
    """The table and its notes, without the title."""
    report = current_names(report)
    m, cfg, bw, w = report["machine"], report["config"], report["bandwidth"], report["weights"]
    v = m["versions"]
    kinds = list(report["summary"])
    lines = [
        f"- machine: {m['cpu']}, {m['physical_cores']} physical cores / {m['logical_cpus']} "
        f"logical ({m['usable_cpus']} usable), {cfg['threads']} threads for every system; "
        f"load average {report['load_before']} before, {report['load_after']} after",
        f"- versions: python {m['python']}, " + ", ".join(f"{k} {x}" for k, x in v.items()),
        f"- prompts: {report['prompt_counts']} (chat-templated, identical ids for every system), "
        f"{cfg['repeats']} repeat(s), EOS mode `{cfg['eos']}`",
        f"- memory copy bandwidth {bw['GBps']:.1f} GB/s (numpy, {bw['array_bytes'] / 2**20:.0f} "
        f"MiB, read+write); target weights {w['bytes'] / 1e6:.0f} MB → bandwidth floor "
        f"{w['floor_ms_per_token']:.1f} ms/token, ceiling **{w['ceiling_tokens_per_s']:.1f} "
        f"tok/s** for target-only decoding",
        f"- draftproof target: {target_summary(report)}",
        f"- draftproof-spec: draft {draft_summary(report['draft'])}, γ {cfg['gamma_used']}; "
        f"HF prompt_lookup_num_tokens "
        f"{cfg['prompt_lookup']}; onnxruntime-genai n-gram: ngram_size {cfg['genai_ngram_size']}"
        f", max_draft_tokens {cfg['genai_max_draft']}, chained {cfg['genai_chained']}",
        "",
        "tokens/s: median (p25–p75) over prompts × repeats; ×hf: median over hf's median; "
        "acc: accepted / proposed draft tokens.",
        "",
        "| system | " + " | ".join(f"{k} tok/s | {k} ×hf" for k in kinds) + f" | acc ({kinds[-1]}) "
        "| diverged from (hf, else own plain mode) |",
        "|---|" + "---:|---:|" * len(kinds) + "---:|---|",
    ]
    div = report["divergence"]
    for name in SYSTEMS:
        if name in report["skipped"]:
            lines.append(f"| {name} | skipped: {report['skipped'][name]} |")
            continue
        cells = []
        for k in kinds:
            row = report["summary"][k].get(name)
            if row is None:
                cells += ["–", "–"]
                continue
            q = row["tokens_per_s"]
            cells += [f"{q['median']:.1f} ({q['p25']:.1f}–{q['p75']:.1f})",
                      f"{row['vs_hf']:.2f}" if "vs_hf" in row else "–"]
        acc = report["summary"][kinds[-1]].get(name, {}).get("acceptance")
        mine = [d for d in div if d["system"] == name]
        diverged = [d for d in mine if d["first_diff"] is not None]
        dtext = ("(reference)" if name == REFERENCE and mine == [] else "–" if not mine
                 else f"{len(diverged)}/{len(mine)} prompts vs {mine[0]['reference']}")
        lines.append(f"| {name} | " + " | ".join(cells) +
                     f" | {'–' if acc is None else f'{acc:.2f}'} | {dtext} |")
    lines += targets_lines(report)
    diverged = [d for d in div if d["first_diff"] is not None]
    if diverged:
        lines += ["", "First divergence from the reference's greedy tokens (gap, with hf as "
                  "the reference: HF logit of its token − logit of the system's token at that "
                  "position; < ~1e-3 is a near-tie):", "",
                  "| prompt | kind | system | reference | index | ref token | system token | gap | "
                  "top-2 gap |",
                  "|---:|---|---|---|---:|---:|---:|---:|---:|"]
        for d in diverged:
            gap = f"{d['gap']:.2e}" if "gap" in d else "–"
            top2 = f"{d['top2_gap']:.2e}" if "top2_gap" in d else "–"
            lines.append(f"| {d['prompt']} | {d['kind']} | {d['system']} | {d['reference']} | "
                         f"{d['first_diff']} | "
                         f"{d.get('ref_token', '–')} | {d.get('got_token', '–')} | {gap} | "
                         f"{top2} |")
    hits = {d["prompt"]: d["ref_eos_at"] for d in div
            if d["ref_eos_at"] is not None and d["reference"] == REFERENCE}
    if hits and cfg["eos"] == "continue":
        lines += ["", f"hf greedy emitted EOS early in {len(hits)} prompt(s) (index: "
                  f"{hits}); with `--eos continue` the tokens after it are the model continuing "
                  "past its answer, which the n-gram drafts can find easy to predict."]
    if report.get("float_agreement"):
        lines += ["", f"Greedy tokens equal to the float model's (hf in "
                  f"{report['config']['float_reference']}) before the first difference, per "
                  "prompt:", "", "| system | median | mean | identical over all tokens |",
                  "|---|---:|---:|---:|"]
        for name, a in report["float_agreement"].items():
            lines.append(f"| {name} | {a['median']:.0f} | {a['mean']:.1f} | "
                         f"{a['identical']}/{a['prompts']} |")
    if report.get("notes"):
        lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def target_summary(report: dict) -> str:
    q = report.get("target_quantization")
    return report["config"]["precision"] + (f", {q['method']}" if q else "") + \
        f" (bundle {report['bundle']})"


def draft_summary(draft: dict) -> str:
    """The manifest's draft entry without its graph contract."""
    if draft.get("kind") == "hybrid":
        model = draft_summary({**draft, "kind": "model"})
        return (f"hybrid: prompt lookup (n-grams {draft.get('min_ngram')}–{draft.get('max_ngram')})"
                f" or {model}, measured cost {draft.get('draft_cost')} of a target step")
    if draft.get("kind") != "model":
        return json.dumps({k: v for k, v in draft.items() if k != "graphs"})
    q = draft.get("quantization") or {}
    agree = (draft.get("parity") or {}).get(draft.get("precision"), {})
    text = f"model {draft.get('gguf_file') or draft.get('source')} at {draft.get('precision')}"
    if q:
        text += f" ({q.get('method')})"
    if agree:
        text += (f", top-1 {agree['top1_agreement']:.2f} / KL {agree['mean_kl']:.3f} vs the "
                 "float model")
    return text


def targets_lines(report: dict) -> list[str]:
    """The issue's speed targets for this precision: our median over the peer's, per kind."""
    out = []
    for ours, peer, wanted in TARGETS.get(report["config"]["precision"], []):
        cells = []
        for kind, rows in report["summary"].items():
            if ours in rows and peer in rows:
                r = rows[ours]["tokens_per_s"]["median"] / rows[peer]["tokens_per_s"]["median"]
                cells.append(f"{kind} {r:.2f}× {'met' if r >= wanted else 'missed'}")
        if cells:
            out.append(f"- target {ours} ≥ {wanted}× {peer}: " + ", ".join(cells))
    return ["", "Targets (median tokens/s ratios from this run):", ""] + out if out else []


def float_agreement(runs, prompts, reference: Path) -> dict:
    """Per system: tokens of its greedy output (first repeat) equal to the float model's (the
    reference run's hf row on the same prompt ids) before the first difference. A quantized
    model that follows its float model for long is close to it where it counts: on its own
    greedy path."""
    ref = json.loads(reference.read_text())
    ref_ids = [p["ids"] for p in ref["prompts"]]
    hf = {r["prompt"]: r["tokens"] for r in ref["runs"] if r["system"] == REFERENCE
          and r["repeat"] == 0}
    out = {}
    for r in runs:
        if r["repeat"] or prompts[r["prompt"]]["ids"] not in ref_ids:
            continue
        want = hf.get(ref_ids.index(prompts[r["prompt"]]["ids"]))
        if want is None:
            continue
        same = next((k for k, (a, b) in enumerate(zip(want, r["tokens"])) if a != b),
                    min(len(want), len(r["tokens"])))
        out.setdefault(r["system"], []).append((same, same == len(want)))
    return {name: {"median": float(np.median([n for n, _ in v])),
                   "mean": float(np.mean([n for n, _ in v])),
                   "identical": sum(whole for _, whole in v), "prompts": len(v)}
            for name, v in out.items()}


def write_results(stem: Path, report: dict, table: str) -> None:
    """STEM.json (everything) and STEM.md (the table)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(table)


def dated(report: dict, directory: Path, **given) -> Path:
    """The run's dated report: the table of markdown() and plot(), as
    DIRECTORY/compare-<precision>-<date>.md and .png."""
    return reports.write_run_report(
        report, directory, f"compare-{report['config']['precision']}", title=title(report),
        sections=body(report), figure=plot(report), **given)


def plot(report: dict):
    """reports.speed_plot: tok/s per system and prompt kind, and each speculative mode over
    its own plain mode (PLAIN_OF). Ours: the first two of SYSTEMS, or the names a run stored
    before they changed. None without matplotlib."""
    present = list(dict.fromkeys(n for rows in report["summary"].values() for n in rows))
    names = [n for n in SYSTEMS if n in present] + [n for n in present if n not in SYSTEMS]
    ours = set(SYSTEMS[:2]) | set(STORED_OURS)
    plain_of = {STORED_OURS[1]: STORED_OURS[0], **PLAIN_OF}
    return reports.speed_plot(report["summary"], names, plain_of, ours=ours,
                              heading=f"{report['config']['precision']}: ours against peers")


STORED_OURS = ("specedge", "specedge-spec")  # our rows' names in runs stored until 2026-12-04
