"""The pair race: a real target drafted by a smaller model of its family (by default the
Qwen2.5-Coder 1.5B and 0.5B GGUF files of real_models.py), every system on the same weights, one
table per precision. Run through `compare.py --pair` or directly:

    python benchmarks/pair.py --precision fp32 --openvino-python OVENV/bin/python \\
        --draftproof-target target-only=B_T --draftproof draft-0.5b=B_D --draftproof auto=B_A

Systems (names for --skip; PEERS below says what each runs):
    hf, hf-draft, hf-lookup                      transformers in PyTorch (fp32 table)
    ortgenai, ortgenai-ngram, ortgenai-draft     onnxruntime-genai on its own builds
    openvino, openvino-lookup, openvino-draft    OpenVINO GenAI on optimum-intel's IR
    llamacpp, llamacpp-ngram, llamacpp-draft     llama.cpp's own llama-server, built natively
                                                 (llama_server.py), on the GGUF files
    ours: each --draftproof NAME=BUNDLE (speculative) and --draftproof-target NAME=BUNDLE
    (use_draft=False on the same engines) is a row of its own

Every system runs in a worker process of its own (worker.py; OpenVINO: ov_worker.py in its own
environment): its peak RSS is its own. The draft-model modes first get a sweep of their
draft length k (and draft precision; OpenVINO also its confidence threshold, llama.cpp its
p_min) on --sweep-prompts prompts, one of each kind; the best goes into the race. The race
passes over the prompts --repeats times; in each pass the systems take turns prompt by prompt
(or --turn-prompts prompts a turn), in an order that rotates every turn over all passes (see
race); a system's turn starts with a warm-up on a prompt of its own. When the systems'
model files do not fit in memory together (--resident auto), each turn starts the system's
worker and ends it afterwards, so only one model is loaded at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine
import model_files
import pair_report
from pair_workers import Pool, WorkerError, mem_available
import peers
import real_models
import reports

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "pair_prompts.json"
WARMUP = "Write a haiku about compilers."  # not one of the race's prompts: no shared prefix
SWEEP_K = (2, 3, 4, 5, 6, 8, 10, 12, 16)  # the winner so far was 5-8: room on both sides
OV_THRESHOLDS = (0.2, 0.4, 0.6)  # assistant_confidence_threshold, instead of a fixed k
LLAMA_P_MIN = (0.0, 0.75)  # llama.cpp's --spec-draft-p-min: its default, and its docs' example
PLAIN_OF = {"hf-draft": "hf", "hf-lookup": "hf", "ortgenai-ngram": "ortgenai",
            "ortgenai-draft": "ortgenai", "openvino-lookup": "openvino",
            "openvino-draft": "openvino", "llamacpp-ngram": "llamacpp",
            "llamacpp-draft": "llamacpp"}
PEERS = tuple(["hf", "ortgenai", "openvino", "llamacpp"] + list(PLAIN_OF))


@dataclass
class System:
    name: str
    cmds: list[list[str]]  # worker command lines: one, or one per draft variant to sweep
    labels: list[str]  # what each command runs (its draft), for the sweep table
    family: str  # ours, hf, ortgenai, openvino, llamacpp
    plain: str | None = None  # its own target-only row, for "= own greedy"
    weight_bytes: int = 0  # the target's weights a step reads: a plain row's ceiling
    footprint: int = 0  # every model file it loads: its memory estimate
    sweep: tuple = ()  # per-call options to sweep ({"k": 5}, {} = its own default); () = none
    options: dict = field(default_factory=dict)  # per-call options the sweep chose
    what: str = ""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=["fp32", "int4"], default="fp32")
    ap.add_argument("--target-gguf", type=Path, help="default: real_models.py's qwen-1.5b")
    ap.add_argument("--draft-gguf", type=Path, help="default: real_models.py's qwen-0.5b")
    ap.add_argument("--draftproof", action="append", default=[],
                    metavar="NAME=BUNDLE",
                    help="a speculative row of ours (repeatable)")
    ap.add_argument("--draftproof-target", action="append", default=[],
                    metavar="NAME=BUNDLE",
                    help="a target-only row of ours (use_draft=False): what our speculative "
                    "rows of the same bundle are compared with for '= own greedy' (the first "
                    "one for a bundle without its own)")
    ap.add_argument("--draftproof-python", type=Path,
                    default=Path(sys.executable),
                    help="python whose spec_runtime runs our rows (default: this one)")
    ap.add_argument("--ours-default", metavar="NAME", help="the row of ours that is the "
                    "default bundle (target: within 10%% of our best mode)")
    ap.add_argument("--gamma", type=reports.gamma, default=None, help="γ for our rows: integer or 'auto' "
                    "(default: each bundle's)")
    ap.add_argument("--openvino-python", type=Path, help="python of the OpenVINO environment")
    ap.add_argument("--draft-precisions", default="int4,fp32",
                    help="the peers' draft builds to sweep (onnxruntime-genai, OpenVINO)")
    ap.add_argument("--sweep-k", default=",".join(map(str, SWEEP_K)),
                    help="draft lengths to sweep; '' for no sweep (then --draft-k)")
    ap.add_argument("--draft-k", type=int, default=4, help="draft length without a sweep")
    ap.add_argument("--sweep-prompts", type=int, default=3,
                    help="prompts of the sweep (the first of code, then chat, then grounded)")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--limit", type=int, help="first N prompts of each kind")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eos", choices=["stop", "continue"], default="stop")
    ap.add_argument("--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    ap.add_argument("--llama-cpp-bin", type=Path,
                    help="directory of a native llama.cpp build's llama-server (default: "
                    "$LLAMA_CPP_BIN; benchmarks/README.md says how to build it)")
    ap.add_argument("--llamacpp-gguf", type=Path,
                    help="llama.cpp's model (default: the target GGUF, int4 table only)")
    ap.add_argument("--llamacpp-draft-gguf", type=Path,
                    help="llama.cpp's draft (default: the draft GGUF, int4 table only)")
    ap.add_argument("--llamacpp-ngram", default="ngram-simple",
                    help="llama-server --spec-type of the llamacpp-ngram row")
    ap.add_argument("--genai-ngram", default="3,8,chained",
                    help="onnxruntime-genai n-gram: size,max_draft_tokens,chained|plain")
    ap.add_argument("--ov-lookup", default="8,3",
                    help="OpenVINO prompt lookup: num_assistant_tokens,max_ngram_size")
    ap.add_argument("--turn-prompts", type=int, default=1,
                    help="prompts a system runs in one turn (one load, when workers are loaded "
                    "per turn): 1 alternates prompt by prompt; more saves loads")
    ap.add_argument("--resident", choices=["auto", "all", "one"], default="auto",
                    help="all: every worker stays loaded; one: a worker per turn; auto: all "
                    "when the model files fit in 70%% of the available memory")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME",
                    help="leave a system out (repeatable)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only these systems (repeatable)")
    ap.add_argument("--float-reference", type=Path,
                    help="a pair-fp32.json of the same prompts: how long each system's greedy "
                    "output follows the fp32 model's (hf), and × HF for a table without hf")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "local",
                    help="directory for pair-<precision>.{json,md} (default: "
                    "benchmarks/results/local, git-ignored)")
    ap.add_argument("--replace", action="store_true", help="overwrite existing result files")
    reports.add_options(ap, default="--out, beside pair-<precision>.json")
    args = ap.parse_args(argv)
    if args.from_json:
        return args  # nothing runs: the report of a stored race (main)
    for name in ("max_new_tokens", "repeats", "threads", "sweep_prompts", "turn_prompts"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    args.sweep_k = tuple(int(k) for k in args.sweep_k.split(",") if k)
    args.draft_precisions = [p for p in args.draft_precisions.split(",") if p]
    bad = [p for p in args.draft_precisions if p not in ("int4", "fp32")]
    if bad:
        ap.error(f"--draft-precisions {bad}: use int4 and/or fp32")
    for flag in ("draftproof", "draftproof_target"):
        for item in getattr(args, flag):
            name, _, bundle = item.partition("=")
            if not name or not bundle or not (Path(bundle) / "manifest.json").is_file():
                ap.error(f"--{flag.replace('_', '-')} {item!r}: give NAME=BUNDLE, BUNDLE a "
                         "directory with manifest.json (`specexport build --out BUNDLE`)")
    stems = [args.out / f"pair-{args.precision}{ext}" for ext in (".json", ".md")]
    if not args.replace and any(p.exists() for p in stems):
        ap.error(f"{stems[0]} exists: pass --replace to overwrite it, or another --out")
    return args


# -- systems ------------------------------------------------------------------------------------

def size(path: Path) -> int:
    path = Path(path)
    return model_files.dir_bytes(path) if path.is_dir() else path.stat().st_size


def bundle_target_bytes(bundle: Path) -> int:
    manifest = json.loads((Path(bundle) / "manifest.json").read_text())
    return model_files.step_bytes(Path(bundle) / manifest["target"]["graphs"]["decoder"]["file"])


def worker_cmd(spec: dict, python: Path | None = None) -> list[str]:
    return [str(python or sys.executable), str(HERE / "worker.py"), json.dumps(spec)]


def ov_cmd(args, model: Path, mode: str, eos_ids, draft: Path | None = None) -> list[str]:
    tokens, ngram = args.ov_lookup.split(",")
    cmd = [str(args.openvino_python), str(HERE / "ov_worker.py"), "--model", str(model),
           "--mode", mode, "--threads", str(args.threads), "--lookup-tokens", tokens,
           "--ngram", ngram, "--draft-tokens", str(args.draft_k),
           "--eos-ids", ",".join(map(str, eos_ids))]
    cmd += ["--f32"] if args.precision == "fp32" else []
    cmd += ["--ignore-eos"] if args.eos == "continue" else []
    cmd += ["--draft", str(draft)] if draft else []
    return cmd


def build_systems(args, target: Path, draft: Path, eos_ids: list[int]):
    """-> ([System], {name: skip reason}). Peer model files are built here when missing
    (model_files.py; minutes each, the first time)."""
    stop, p = args.eos == "stop", args.precision
    common = {"threads": args.threads, "stop_at_eos": stop}
    sweep = args.sweep_k
    ks = tuple({"k": k} for k in sweep)
    systems, skipped = [], {}
    hf_t, hf_d = model_files.hf_dir(target), model_files.hf_dir(draft)
    if p == "fp32":
        hf = {**common, "kind": "hf", "model": str(hf_t), "eos_ids": eos_ids}
        st = model_files.step_bytes(hf_t / "model.safetensors")
        sf = size(hf_t / "model.safetensors")
        systems += [
            System("hf", [worker_cmd(hf)], ["-"], "hf", None, st, sf, what="PyTorch eager"),
            System("hf-draft", [worker_cmd({**hf, "assistant": str(hf_d)})], ["0.5B fp32"],
                   "hf", "hf", st, sf + size(hf_d), ({}, *ks) if ks else (),
                   what="assistant_model (the draft at fp32)"),
            System("hf-lookup", [worker_cmd({**hf, "lookup": args.prompt_lookup})], ["-"], "hf",
                   "hf", st, sf, what=f"prompt_lookup_num_tokens {args.prompt_lookup}")]
    else:
        skipped.update({n: "no comparable int4 CPU path in transformers (the fp32 table has "
                        "its rows)" for n in ("hf", "hf-draft", "hf-lookup")})
    genai_t = model_files.ortgenai_dir(p, target)
    genai = {**common, "kind": "ortgenai", "model": str(genai_t), "eos_id": eos_ids[0]}
    gt, gf = (model_files.step_bytes(genai_t / "model.onnx"),
              model_files.onnx_weight_bytes(genai_t / "model.onnx"))
    size_, k, chained = args.genai_ngram.split(",")
    ngram = {"ngram_size": int(size_), "max_draft_tokens": int(k),
             "ngram_chained_lookup": chained == "chained"}
    drafts = {dp: model_files.ortgenai_dir(dp, draft) for dp in args.draft_precisions}
    systems += [
        System("ortgenai", [worker_cmd(genai)], ["-"], "ortgenai", None, gt, gf,
               what=f"its builder's -p {p}"),
        System("ortgenai-ngram", [worker_cmd({**genai, "spec": ngram})], ["-"], "ortgenai",
               "ortgenai", gt, gf, what=f"n-gram {args.genai_ngram}"),
        System("ortgenai-draft",
               [worker_cmd({**genai, "draft": str(d), "spec": {"max_draft_tokens": args.draft_k}})
                for d in drafts.values()], [f"0.5B {dp}" for dp in drafts], "ortgenai",
               "ortgenai", gt, gf + max(map(size, drafts.values())), ks,
               what="draft model (model.draft in genai_config)")]
    why = peers.openvino_missing(args.openvino_python)
    if why:
        skipped.update({n: why for n in ("openvino", "openvino-lookup", "openvino-draft")})
    else:
        ov_t = model_files.openvino_dir(args.openvino_python, p, target)
        ov_drafts = {dp: model_files.openvino_dir(args.openvino_python, dp, draft)
                     for dp in args.draft_precisions}
        ot = model_files.step_bytes(ov_t / "openvino_model.xml")
        of = size(ov_t / "openvino_model.bin")
        how = "true f32" if p == "fp32" else "CPU defaults (bf16, u8 KV)"
        systems += [
            System("openvino", [ov_cmd(args, ov_t, "plain", eos_ids)], ["-"], "openvino", None,
                   ot, of, what=how),
            System("openvino-lookup", [ov_cmd(args, ov_t, "lookup", eos_ids)], ["-"],
                   "openvino", "openvino", ot, of, what=f"prompt lookup {args.ov_lookup}"),
            System("openvino-draft", [ov_cmd(args, ov_t, "draft", eos_ids, d)
                                      for d in ov_drafts.values()],
                   [f"0.5B {dp}" for dp in ov_drafts], "openvino", "openvino", ot,
                   of + max(map(size, ov_drafts.values())),
                   ks + tuple({"threshold": t} for t in OV_THRESHOLDS if sweep),
                   what="draft_model (the draft at its CPU defaults)")]
    try:
        systems += llamacpp_systems(args, target, draft, common)
    except Skip as e:
        skipped.update({n: e.why for n in e.names})
    systems += our_systems(args, common)
    wanted = [s for s in systems if s.name not in args.skip and
              (not args.only or s.name in args.only)]
    skipped.update({s.name: "--skip" if s.name in args.skip else "not in --only"
                    for s in systems if s not in wanted})
    return wanted, skipped


def our_systems(args, common: dict) -> list[System]:
    """A row per --draftproof-target (use_draft=False) and --draftproof bundle; a speculative row's
    "= own greedy" is against the target-only row of its own bundle, else the first one."""
    plains = [(n, Path(b).resolve()) for n, b in
              (item.partition("=")[::2] for item in args.draftproof_target)]
    systems = []
    for flag, use_draft in ((args.draftproof_target, False), (args.draftproof, True)):
        for item in flag:
            name, _, bundle = item.partition("=")
            spec = {**common, "kind": "draftproof", "bundle": bundle, "use_draft": use_draft,
                    "gamma": args.gamma}
            own = next((n for n, b in plains if b == Path(bundle).resolve()),
                       plains[0][0] if plains else None)
            systems.append(System(name, [worker_cmd(spec, args.draftproof_python)], ["-"], "ours",
                                  own if use_draft else None, bundle_target_bytes(bundle),
                                  size(bundle), what=f"bundle {bundle}" +
                                  ("" if use_draft else ", use_draft=False")))
    return systems


def llamacpp_systems(args, target: Path, draft: Path, common: dict) -> list[System]:
    """llama-server plain, with an n-gram mode, and with the draft (-md), each on a server of
    its own; the draft row's variants are servers with each --spec-draft-n-max × p_min (this
    build takes them on the command line only). Skipped (raises Skip) without the binary."""
    import llama_server

    gguf = args.llamacpp_gguf or (target if args.precision == "int4" else None)
    dgguf = args.llamacpp_draft_gguf or (draft if args.precision == "int4" else None)
    why = llama_server.missing(args.llama_cpp_bin) or (
        None if gguf and dgguf else "no fp32 GGUF pair given (--llamacpp-gguf, "
        "--llamacpp-draft-gguf); the int4 table has llama.cpp on the GGUF files themselves")
    if why:
        raise Skip(why, ("llamacpp", "llamacpp-ngram", "llamacpp-draft"))
    server = {**common, "kind": "llama-server", "gguf": str(gguf),
              "binary": str(llama_server.find_binary(args.llama_cpp_bin))}
    g, gf = model_files.step_bytes(Path(gguf)), size(gguf)
    variants = [(k, p) for k in (args.sweep_k or (args.draft_k,)) for p in LLAMA_P_MIN]
    n_maxes = args.sweep_k or (args.draft_k,)
    return [
        System("llamacpp", [worker_cmd(server)], ["-"], "llamacpp", None, g, gf,
               what=f"llama-server on {Path(gguf).name}"),
        System("llamacpp-ngram", [worker_cmd({**server, "spec_type": args.llamacpp_ngram,
                                              "n_max": n}) for n in n_maxes],
               [f"n_max {n}" for n in n_maxes], "llamacpp", "llamacpp", g, gf,
               ({},) if len(n_maxes) > 1 else (),
               what=f"llama-server --spec-type {args.llamacpp_ngram}"),
        System("llamacpp-draft", [worker_cmd({**server, "draft": str(dgguf), "n_max": k,
                                              "p_min": p}) for k, p in variants],
               [f"{Path(dgguf).name} n_max {k} p_min {p}" for k, p in variants], "llamacpp",
               "llamacpp", g, gf + size(dgguf), ({},) if len(variants) > 1 else (),
               what="llama-server -md (its draft-model mode)")]


class Skip(Exception):
    def __init__(self, why: str, names):
        super().__init__(why)
        self.why, self.names = why, names


# -- sweep and race -----------------------------------------------------------------------------

def sweep(systems, prompts, args, pool: Pool) -> list[dict]:
    """Each draft-model mode: every variant (a command: draft build, or server settings) ×
    per-call option set (a draft length k, a confidence threshold) on the sweep prompts, once
    each; the pair with the most tokens per second of wall time goes into the race."""
    kinds = ["code", "chat", "grounded"]
    chosen = [next(p for p in prompts if p["kind"] == k) for k in kinds
              if any(p["kind"] == k for p in prompts)][:args.sweep_prompts]
    rows = []
    for s in systems:
        if not s.sweep:
            continue
        best = None
        for i, label in enumerate(s.labels):
            pool.stop(s.name)
            w = pool.start(s, i)
            for options in s.sweep:
                tokens = wall = 0
                for p in chosen:
                    a = w.run(p["ids"], args.max_new_tokens, options)
                    pool.note_rss(s.name, a)
                    tokens, wall = tokens + len(a["tokens"]), wall + a["wall_s"]
                rows.append({"system": s.name, "draft": label, "options": options,
                             "k": options.get("k"), "new_tokens": tokens, "wall_s": wall,
                             "tokens_per_s": tokens / wall})
                print(f"  sweep {s.name} {label} {options or ''}: {tokens / wall:.2f} tok/s",
                      file=sys.stderr, flush=True)
                if best is None or tokens / wall > best[0]:
                    best = (tokens / wall, i, options)
            pool.stop(s.name)
        _, i, options = best
        for r in rows:
            if r["system"] == s.name:
                r["chosen"] = r["draft"] == s.labels[i] and r["options"] == options
        s.cmds, s.labels, s.options = [s.cmds[i]], [s.labels[i]], options
    pool.peak.clear()  # the race's own peaks: the sweep ran other variants
    return rows


def turns(n_prompts: int, step: int, repeats: int):
    """(turn number, repetition, prompt indices) of the race: --repeats passes over the prompts
    in blocks of `step`, turns numbered across the passes."""
    t = 0
    for rep in range(repeats):
        for first in range(0, n_prompts, step):
            yield t, rep, list(range(first, min(first + step, n_prompts)))
            t += 1


def race(systems, prompts, args, pool: Pool, failed: dict) -> tuple[list, list]:
    """Every turn each live system runs the turn's prompts once, in an order rotated by
    `stride` systems a turn: over at least as many turns as systems (stride 1) each system
    runs in every slot; over fewer, the stride spreads each system's slots from first to last."""
    runs, loads = [], []
    n_turns = args.repeats * -(-len(prompts) // args.turn_prompts)
    stride = max(1, len(systems) // n_turns)
    for t, rep, block in turns(len(prompts), args.turn_prompts, args.repeats):
        live = [s for s in systems if s.name not in failed]
        shift = t * stride % len(live) if live else 0
        order = live[shift:] + live[:shift]
        for slot, s in enumerate(order):
            try:
                w = pool.start(s)
                for i in block:
                    p = prompts[i]
                    a = w.run(p["ids"], args.max_new_tokens, s.options)
                    pool.note_rss(s.name, a)
                    runs.append({"prompt": i, "kind": p["kind"], "repeat": rep, "slot": slot,
                                 "system": s.name, "new_tokens": len(a["tokens"]),
                                 "wall_s": a["wall_s"],
                                 "tokens_per_s": len(a["tokens"]) / a["wall_s"],
                                 "info": a["info"], "tokens": a["tokens"]})
                pool.end_turn(s.name)
            except (WorkerError, json.JSONDecodeError, BrokenPipeError) as e:
                pool.stop(s.name)
                failed[s.name] = f"failed in turn {t}: {str(e)[-600:]}"
                print(f"  {s.name} FAILED: {failed[s.name]}", file=sys.stderr, flush=True)
        loads.append({"after_prompt": block[-1], "repeat": rep, "loadavg": os.getloadavg(),
                      "mem_available": mem_available()})
        print(f"  pass {rep + 1}/{args.repeats}, prompts {block[0] + 1}-{block[-1] + 1}/"
              f"{len(prompts)} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    return runs, loads


# -- setup --------------------------------------------------------------------------------------

def prepare_prompts(hf_target: Path, args) -> tuple[list[dict], list[int], list[int]]:
    """Prompt texts → chat-templated token ids, once, with the target's own tokenizer and
    template; every system gets these ids. -> (prompts, warm-up ids, EOS ids)."""
    from transformers import AutoTokenizer

    from spec_runtime.apps.bench import load_prompts

    tok = AutoTokenizer.from_pretrained(hf_target)
    prompts = load_prompts(args.prompts)
    prompts = interleave(prompts, args.limit)

    def ids(text):
        out = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    for p in prompts:
        p["ids"] = [int(t) for t in ids(p["text"])]
    config = json.loads((hf_target / "generation_config.json").read_text())
    eos = config.get("eos_token_id", tok.eos_token_id)
    eos = [eos] if isinstance(eos, int) else list(eos)
    return prompts, [int(t) for t in ids(WARMUP)], eos


def interleave(prompts: list[dict], limit: int | None = None) -> list[dict]:
    """The first `limit` prompts of each kind, kinds taking turns (code, grounded, chat, code,
    ...): drift of the machine spreads over every kind, and a block of --turn-prompts holds
    several kinds."""
    by_kind: dict[str, list] = {}
    for p in prompts:
        by_kind.setdefault(p["kind"], []).append(p)
    depth = min(limit or len(prompts), max(map(len, by_kind.values())))
    return [q[i] for i in range(depth) for q in by_kind.values() if i < len(q)]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"loadavg {os.getloadavg()}"


def from_json(args) -> None:
    """The dated report of a stored race (its pair-<precision>.json), nothing measured."""
    report = pair_report.complete(json.loads(args.from_json.read_text()))
    reports.rebuilt(args, report, reports.directory(args), pair_report.dated)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_json:
        return from_json(args)
    target = args.target_gguf or real_models.fetch("qwen-1.5b")
    draft = args.draft_gguf or real_models.fetch("qwen-0.5b")
    started, up_before = time.time(), uptime()
    date = time.strftime("%Y-%m-%dT%H:%M:%S")
    prompts, warmup, eos_ids = prepare_prompts(model_files.hf_dir(target), args)
    print(f"{len(prompts)} prompts; setting up systems (model files built when missing) ...",
          file=sys.stderr, flush=True)
    systems, skipped = build_systems(args, target, draft, eos_ids)
    fit = sum(s.footprint for s in systems) < 0.7 * mem_available()
    resident = args.resident == "all" or (args.resident == "auto" and fit)
    logs = args.out / f"pair-{args.precision}-logs"
    pool = Pool(resident, logs, warmup, min(args.max_new_tokens, 16))
    bw_before = machine.copy_bandwidth()
    failed: dict = {}
    try:
        sweep_rows = sweep(systems, prompts, args, pool)
        runs, loads = race(systems, prompts, args, pool, failed)
    finally:
        pool.close()
    bw_after = machine.copy_bandwidth()
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "date": date, "command": reports.command_line(),
        "target_gguf": str(target), "draft_gguf": str(draft), "eos_ids": eos_ids,
        "machine": machine.info(args.threads),
        "uptime_before": up_before, "uptime_after": uptime(), "loads": loads,
        "wall_minutes": (time.time() - started) / 60,
        "bandwidth": {"before": bw_before, "after": bw_after,
                      "GBps": max(bw_before["GBps"], bw_after["GBps"])},
        "resident": resident,
        "systems": {s.name: {"family": s.family, "what": s.what, "draft": s.labels[0],
                             "options": s.options, "plain": s.plain, "cmd": s.cmds[0],
                             "weight_bytes": s.weight_bytes, "footprint": s.footprint,
                             "load_s": pool.loads.get(s.name, []),
                             "versions": pool.versions.get(s.name),
                             "peak_rss": pool.peak.get(s.name)} for s in systems},
        "skipped": {**skipped, **failed},
        "sweep": sweep_rows,
        "runs": runs,
        "prompts": [{"kind": p["kind"], "text": p["text"], "ids": p["ids"]} for p in prompts],
    }
    pair_report.write(report, args)


if __name__ == "__main__":
    main()
