"""draftproof against its peers on one CPU: same model, same prompt token ids, same number of new
tokens, greedy, tokens/s measured in one run.

Systems (names for --skip):
    draftproof        spec_runtime, target-only (use_draft=False)
    draftproof-spec   spec_runtime, speculative with the bundle's draft (the default bundle's:
                      the target's own GGUF blocks at int4)
                      (results before the rename call these two specedge and specedge-spec)
    hf                transformers `generate` in PyTorch, greedy
    hf-lookup         the same with prompt lookup (`prompt_lookup_num_tokens`)
    ortgenai          onnxruntime-genai on its own model-builder build of the same weights
    ortgenai-ngram    the same with its n-gram speculative mode
    llamacpp          llama.cpp (llama-cpp-python) on the Q4_1 GGUF itself (int4 table only)
    llamacpp-lookup   the same with its prompt-lookup speculative mode
    openvino          OpenVINO GenAI on optimum-intel's IR of the same weights: true f32 in the
                      fp32 table (INFERENCE_PRECISION_HINT / KV_CACHE_PRECISION f32), its int4
                      IR at its CPU defaults (bf16 compute, u8 KV cache) in the int4 table
    openvino-lookup   the same with prompt lookup (--ov-lookup-tokens, --ov-ngram)
    openvino-draft    the same with its int4 IR as draft model (fp32 table only)

tokens/s = new tokens / wall time of the whole generate call (prefill included); the table shows
the median per system and prompt kind. After one warm-up call per system, the systems take turns
on every prompt, in an order that rotates, so that drift of the machine spreads over all of them.
Outputs are compared token for token with `hf` (greedy), with HF's logit gap at the first
difference: near-ties (tiny gaps) flip with float rounding, large gaps mean a bug.

    python benchmarks/compare.py                              # full run, 10-20 min on 2 cores
    python benchmarks/compare.py --limit 2 --max-new-tokens 16   # smoke test
    python benchmarks/compare.py --pair --help                # the pair race (pair.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (benchmarks/ is not a package)
import model_files  # noqa: E402
import peers  # noqa: E402
import compare_report  # noqa: E402
from compare_report import (  # noqa: E402
    PLAIN_OF, REFERENCE, SYSTEMS, float_agreement, markdown, write_results)
import reports  # noqa: E402

# What each --precision compares. An int4 entry adds the int4 rows: a draftproof bundle exported at
# int4 (--bundle), onnxruntime-genai's `-p int4` build; PyTorch has no comparable CPU int4 path, so
# its rows would be skipped with that reason.
PRECISIONS = {
    "fp32": {"bundle_precision": "fp32", "genai": "fp32", "hf_skip": None,
             "llamacpp_skip": "the shipped GGUF is Q4_1: llama.cpp rows are in the int4 table",
             "openvino": "fp32", "openvino_f32": True, "openvino_draft": "int4"},
    # HF transformers has no 4-bit CPU path comparable to MatMulNBits; its fp32 rows stand in
    # the fp32 table
    "int4": {"bundle_precision": "int4", "genai": "int4",
             "hf_skip": "no comparable int4 CPU path in transformers (see the fp32 table)",
             "llamacpp_skip": None, "openvino": "int4", "openvino_f32": False,
             "openvino_draft": None},
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, help="draftproof bundle (default: `specrun where`)")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    ap.add_argument("--prompts-kind", choices=["grounded", "chat", "all"], default="all")
    ap.add_argument("--prompts", type=Path, help="prompt file for spec_runtime.apps.bench.load_prompts")
    ap.add_argument("--limit", type=int, help="first N prompts of each kind")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs per system and prompt")
    ap.add_argument("--threads", type=int, default=2, help="threads for every system "
                    "(physical cores of the reference machine)")
    ap.add_argument("--gamma", type=reports.gamma, default=None, help="draftproof γ: an integer or 'auto' "
                    "(default: the bundle's)")
    ap.add_argument("--prompt-lookup", type=int, default=10,
                    help="HF prompt_lookup_num_tokens for hf-lookup")
    ap.add_argument("--llamacpp-lookup", type=int, default=10,
                    help="llama-cpp-python LlamaPromptLookupDecoding num_pred_tokens")
    ap.add_argument("--genai-ngram-size", type=int, default=3)
    ap.add_argument("--genai-max-draft", type=int, default=8,
                    help="onnxruntime-genai speculative max_draft_tokens (K)")
    ap.add_argument("--genai-chained", action=argparse.BooleanOptionalAction, default=True,
                    help="onnxruntime-genai ngram_chained_lookup")
    ap.add_argument("--eos", choices=["continue", "stop"], default="continue",
                    help="continue: EOS is an ordinary token and every system makes exactly "
                    "--max-new-tokens; stop: each system stops at EOS (actual tokens counted)")
    ap.add_argument("--openvino-python", type=Path, default=None,
                    help="python of an environment with openvino-genai and optimum-intel "
                         "(benchmarks/README.md); without it the OpenVINO rows are skipped")
    ap.add_argument("--ov-lookup-tokens", type=int, default=8,
                    help="OpenVINO prompt lookup: num_assistant_tokens")
    ap.add_argument("--ov-ngram", type=int, default=3, help="OpenVINO prompt lookup: max_ngram_size")
    ap.add_argument("--skip", action="append", default=[], choices=SYSTEMS, metavar="NAME",
                    help=f"leave a system out (repeatable): {', '.join(SYSTEMS)}")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for compare-PRECISION.json and .md (the committed ones: "
                         "benchmarks/results) [default: print the table, write nothing]")
    ap.add_argument("--float-reference", type=Path, default=None,
                    help="a compare-fp32.json of the same prompts: report how many tokens each "
                    "system's greedy output follows the float model's (hf) before it differs")
    reports.add_options(ap, default="--out, beside compare-PRECISION.json; without --out, none")
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- setup --------------------------------------------------------------------------------------

def prepare_prompts(gen, args) -> list[dict]:
    """Prompt texts → chat-templated token ids, once, with the bundle's tokenizer; every system
    gets these ids."""
    from spec_runtime.apps.bench import load_prompts

    prompts = load_prompts(args.prompts, "all" if args.prompts else args.prompts_kind)
    if args.limit:
        kinds = {p["kind"] for p in prompts}
        prompts = [p for k in sorted(kinds) for p in [q for q in prompts if q["kind"] == k]
                   [:args.limit]]
    for p in prompts:
        text = gen.apply_chat_template(p["text"]) if gen.chat_template else p["text"]
        p["ids"] = gen.tokenize(text, add_special_tokens=not gen.chat_template).tolist()
    return prompts


def build_systems(args, gen, eos_id: int):
    """-> ({name: system}, {name: skip reason}, hf_model or None). `gen` is the loaded bundle
    (both draftproof modes share its engine, as in `specrun bench`). A peer that cannot be set up
    is skipped with its reason rather than ending the run."""
    stop = args.eos == "stop"
    setup = PRECISIONS[args.precision]
    systems, skipped, hf_model = {}, {name: "--skip" for name in args.skip}, None
    wanted = [s for s in SYSTEMS if s not in skipped]
    for name in ("draftproof", "draftproof-spec"):
        if name in wanted:
            systems[name] = peers.Draftproof(gen, name == "draftproof-spec", args.gamma, stop)
    if {"hf", "hf-lookup"} & set(wanted):
        if setup["hf_skip"]:
            skipped.update({n: setup["hf_skip"] for n in ("hf", "hf-lookup") if n in wanted})
        else:
            hf_model = peers.load_hf(model_files.hf_dir(), args.threads)
            for name, lookup in (("hf", 0), ("hf-lookup", args.prompt_lookup)):
                if name in wanted:
                    systems[name] = peers.HFGenerate(hf_model, lookup, stop, eos_id)
    if {"ortgenai", "ortgenai-ngram"} & set(wanted):
        try:
            model = peers.load_ortgenai(model_files.ortgenai_dir(setup["genai"]), args.threads,
                                        stop)
        except Exception as e:  # the peer's build or load failing is a result, not a crash
            skipped.update({n: f"onnxruntime-genai setup failed: {e}"
                            for n in ("ortgenai", "ortgenai-ngram") if n in wanted})
        else:
            ngram = {"ngram_size": args.genai_ngram_size,
                     "max_draft_tokens": args.genai_max_draft,
                     "ngram_chained_lookup": args.genai_chained}
            for name, spec in (("ortgenai", None), ("ortgenai-ngram", ngram)):
                if name in wanted:
                    systems[name] = peers.OrtGenai(model, spec, stop, eos_id)
    llamacpp = [n for n in ("llamacpp", "llamacpp-lookup") if n in wanted]
    why = setup["llamacpp_skip"] or (peers.llamacpp_missing() if llamacpp else None)
    for name in llamacpp:
        if why:
            skipped[name] = why
        else:
            lookup = args.llamacpp_lookup if name == "llamacpp-lookup" else 0
            systems[name] = peers.LlamaCpp(args.threads, lookup, stop, eos_id)
    openvino = [n for n in ("openvino", "openvino-lookup", "openvino-draft") if n in wanted]
    if openvino:
        why = peers.openvino_missing(args.openvino_python)
        for name in openvino:
            if name == "openvino-draft" and not setup["openvino_draft"]:
                skipped[name] = "no lower-precision model of this target to draft with"
            elif why:
                skipped[name] = why
            else:
                try:
                    model = model_files.openvino_dir(args.openvino_python, setup["openvino"])
                    draft = (model_files.openvino_dir(args.openvino_python,
                                                      setup["openvino_draft"])
                             if name == "openvino-draft" else None)
                    mode = {"openvino": "plain", "openvino-lookup": "lookup",
                            "openvino-draft": "draft"}[name]
                    systems[name] = peers.OpenVino(
                        args.openvino_python, model, mode, args.threads, setup["openvino_f32"],
                        stop, draft, args.ov_lookup_tokens, args.ov_ngram)
                except Exception as e:  # its export or load failing is a result, not a crash
                    skipped[name] = f"OpenVINO setup failed: {str(e)[:300]}"
    return systems, skipped, hf_model


# -- measuring ----------------------------------------------------------------------------------

def measure(systems: dict, prompts: list[dict], n: int, repeats: int) -> list[dict]:
    names = list(systems)
    for name in names:  # warm-up: allocations, lazy initialisation, kernel choice
        systems[name].run(prompts[0]["ids"], min(n, 16))
    runs, turn = [], 0
    for i, p in enumerate(prompts):
        for rep in range(repeats):
            order = names[turn % len(names):] + names[:turn % len(names)]
            turn += 1
            for name in order:
                r = systems[name].run(p["ids"], n)
                runs.append({"prompt": i, "kind": p["kind"], "repeat": rep, "system": name,
                             "new_tokens": len(r.tokens), "wall_s": r.wall_s,
                             "tokens_per_s": len(r.tokens) / r.wall_s, "info": r.info,
                             "tokens": r.tokens})
            print(f"  prompt {i + 1}/{len(prompts)} repeat {rep + 1}/{repeats} done",
                  file=sys.stderr, flush=True)
    return runs


def divergences(runs, prompts, hf_model, eos_id) -> list[dict]:
    """Per prompt and system: the first index where its tokens differ from the reference's
    (first repeat), and HF's logit gap there; also whether its repeats disagree."""
    out = []
    by = {}
    for r in runs:
        by.setdefault((r["prompt"], r["system"]), []).append(r["tokens"])
    for i, p in enumerate(prompts):
        for name in SYSTEMS:
            if name == REFERENCE or (i, name) not in by:
                continue
            ref_name = REFERENCE if (i, REFERENCE) in by else PLAIN_OF.get(name)
            if (i, ref_name) not in by:
                continue
            ref = by[(i, ref_name)][0]
            eos_at = ref.index(eos_id) if eos_id in ref else None
            outs = by[(i, name)]
            got = outs[0]
            first = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            if first is None and len(ref) != len(got):
                first = min(len(ref), len(got))
            row = {"prompt": i, "kind": p["kind"], "system": name, "reference": ref_name,
                   "first_diff": first,
                   "ref_eos_at": eos_at, "repeats_agree": all(o == got for o in outs)}
            if first is not None and hf_model is not None and ref_name == REFERENCE and \
                    first < min(len(ref), len(got)):
                row.update(peers.hf_logit_gap(hf_model, p["ids"], ref, first, got[first]))
            out.append(row)
    return out


def quartiles(values) -> dict:
    v = np.asarray(values, dtype=float)
    return {"median": float(np.median(v)), "p25": float(np.percentile(v, 25)),
            "p75": float(np.percentile(v, 75)), "n": len(v)}


def summarise(runs, systems) -> dict:
    """{kind: {system: {tokens_per_s quartiles, vs_hf, acceptance}}}, kinds plus "all"."""
    kinds = sorted({r["kind"] for r in runs})
    kinds += ["all"] if len(kinds) > 1 else []
    out = {}
    for kind in kinds:
        rows = {}
        for name in systems:
            mine = [r for r in runs if r["system"] == name and kind in ("all", r["kind"])]
            if not mine:
                continue
            row = {"tokens_per_s": quartiles([r["tokens_per_s"] for r in mine]),
                   "new_tokens": sum(r["new_tokens"] for r in mine)}
            acc = [(r["info"].get("accepted"), r["info"].get("proposed")) for r in mine]
            if all(a is not None and p is not None for a, p in acc):
                row["acceptance"] = sum(a for a, _ in acc) / max(1, sum(p for _, p in acc))
                row["proposed_per_token"] = sum(p for _, p in acc) / row["new_tokens"]
            rows[name] = row
        ref = rows.get(REFERENCE)
        for row in rows.values():
            if ref:
                row["vs_hf"] = row["tokens_per_s"]["median"] / ref["tokens_per_s"]["median"]
        out[kind] = rows
    return out


def notes(args) -> list[str]:
    out = [
        "onnxruntime-genai n-gram mode is driven from Python: GeneratorParams."
        f"set_speculative_options(ngram_size={args.genai_ngram_size}, max_draft_tokens="
        f"{args.genai_max_draft}, ngram_chained_lookup={args.genai_chained}) on the plain "
        "Generator loop; the same Model object serves both genai rows.",
    ]
    if args.openvino_python:
        how = ("at true f32 (INFERENCE_PRECISION_HINT=f32, KV_CACHE_PRECISION=f32)"
               if PRECISIONS[args.precision]["openvino_f32"] else
               "at its CPU defaults (bf16 compute, u8 KV cache)")
        out.append(f"OpenVINO GenAI runs {how} on optimum-intel's export of the same weights, "
                   f"greedy, token ids in (no chat template of its own), ignore_eos with "
                   f"`--eos continue`; prompt lookup with num_assistant_tokens "
                   f"{args.ov_lookup_tokens}, max_ngram_size {args.ov_ngram}"
                   + ("; its draft mode drafts with the int4 export at its CPU defaults, 4 "
                      "tokens a round."
                      if PRECISIONS[args.precision]["openvino_draft"] else "."))
    if args.precision == "int4":
        out.append("llama.cpp runs through llama-cpp-python's Llama.generate (top_k=1, temp=0), "
                   "context reset before each call; its lookup row uses LlamaPromptLookupDecoding"
                   f"(num_pred_tokens={args.llamacpp_lookup}). llama.cpp computes with the "
                   "GGUF's Q4_1 blocks, ours (by default) with the same blocks in MatMulNBits, "
                   "genai with its builder's own int4 re-quantization of the de-quantized "
                   "weights; activations are 8-bit in all three, so their tokens differ.")
    if args.eos == "continue":
        out.append("EOS is an ordinary token everywhere: draftproof Generator.eos_token_ids "
                   "cleared, HF eos_token_id=None, genai's eos_token_id swapped for "
                   f"{peers.STAND_IN_EOS[0]!r} (none of them masks EOS, so greedy tokens agree).")
    return out


def short_runs(runs, args) -> list[str]:
    """With --eos continue every run must make exactly --max-new-tokens tokens."""
    if args.eos == "stop":
        return []
    return [f"{r['system']} made {r['new_tokens']} tokens on prompt {r['prompt']} (expected "
            f"{args.max_new_tokens}): its tokens/s still counts actual tokens" for r in runs
            if r["new_tokens"] != args.max_new_tokens]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--pair" in argv:  # the pair race: its own options (pair.py --help)
        import pair

        return pair.main([a for a in argv if a != "--pair"])
    args = parse_args(argv)
    if args.from_json:  # the report of a stored run: nothing measured
        stored = json.loads(args.from_json.read_text())
        return reports.rebuilt(args, stored, reports.directory(args), compare_report.dated)
    import spec_runtime
    from spec_runtime.bundle.reader import default_bundle_dir

    bundle_dir = args.bundle or default_bundle_dir()
    load_before = os.getloadavg()[0]
    date = time.strftime("%Y-%m-%dT%H:%M:%S")
    gen = spec_runtime.load(bundle_dir, threads=args.threads)
    want = PRECISIONS[args.precision]["bundle_precision"]
    if gen.manifest.precision != want:
        raise SystemExit(f"bundle {bundle_dir} is {gen.manifest.precision}, --precision "
                         f"{args.precision} needs a {want} bundle: pass --bundle")
    if args.gamma is not None:
        gen.check_gamma(args.gamma)  # a bad γ fails now, not after minutes of peers
    prompts = prepare_prompts(gen, args)
    target_file = bundle_dir / gen.manifest.target.graphs["decoder"].file
    weight_bytes = model_files.onnx_weight_bytes(target_file)
    eos_id = min(gen.eos_token_ids)

    print(f"{len(prompts)} prompts, setting up systems ...", file=sys.stderr)
    systems, skipped, hf_model = build_systems(args, gen, eos_id)
    bw = machine.copy_bandwidth()
    runs = measure(systems, prompts, args.max_new_tokens, args.repeats)
    floor_s = weight_bytes / (bw["GBps"] * 1e9)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["gamma_used"] = gen.default_gamma if args.gamma is None else args.gamma
    report = {
        "date": date, "command": reports.command_line(),
        "config": config,
        "bundle": str(bundle_dir),
        "draft": gen.manifest.to_json()["draft"],
        "target_quantization": gen.manifest.target.quantization,
        "machine": machine.info(args.threads),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "bandwidth": bw,
        "weights": {"file": str(target_file), "bytes": weight_bytes,
                    "floor_ms_per_token": floor_s * 1e3, "ceiling_tokens_per_s": 1 / floor_s},
        "prompt_counts": {k: sum(p["kind"] == k for p in prompts)
                          for k in sorted({p["kind"] for p in prompts})},
        "skipped": skipped,
        "notes": notes(args) + short_runs(runs, args) + machine.busy_note(load_before,
                                                                        os.getloadavg()[0]),
        "summary": summarise(runs, systems),
        "divergence": divergences(runs, prompts, hf_model, eos_id),
        "float_agreement": (float_agreement(runs, prompts, args.float_reference)
                            if args.float_reference else None),
        "runs": runs,
        "prompts": [{"kind": p["kind"], "text": p["text"], "ids": p["ids"]} for p in prompts],
    }
    table = markdown(report)
    print(table)
    if args.out is not None:  # only when asked: never over the committed results by default
        stem = args.out / f"compare-{args.precision}"
        write_results(stem, report, table)
        print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    reports.report(compare_report.dated, report, reports.directory(args, args.out))


if __name__ == "__main__":
    main()
