"""`specrun bench`: speculative vs target-only decoding on the same engines, measured in one run.

For every γ setting and prompt, the two modes run alternately (target-only first on even
repeats, speculative first on odd ones) after a warm-up, so that drift of the machine cancels
in the paired ratio. Everything reported is measured here; the paper's model (Leviathan et al.
2023, Theorem 3.8) is evaluated at the measured α and c next to the measured speedup.
"""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InputError
from ..limits import read_bounded, utf8
from ..request import GenerationOptions
from ..decode.stats import expected_speedup, expected_tokens_per_round

KINDS = ("grounded", "chat")


QUICK_PROMPTS = 3  # built-in prompts per kind in `specrun bench` without --full
# a --prompts file: thousands of prompts, hours of measuring; more is a mistake (/dev/zero)
MAX_PROMPTS_BYTES = 16 << 20


def load_prompts(path=None, kind: str = "all", per_kind: int | None = None) -> list[dict]:
    """[{"kind", "text"}]: the built-in set, or a JSON file of the same shape ({"grounded":
    [...], "chat": [...]}), or a text file with one prompt per non-empty line (kind "custom");
    `per_kind` keeps the first that many of each kind."""
    if path is None:
        data = json.loads(resources.files("spec_runtime").joinpath("data/bench_prompts.json")
                          .read_text(encoding="utf-8"))
    else:
        path = Path(path)
        source = f"--prompts {str(path)!r}"
        try:
            with open(path, "rb") as f:
                raw = utf8(read_bounded(f, MAX_PROMPTS_BYTES, lambda: InputError(
                    f"{source} holds more than {MAX_PROMPTS_BYTES >> 20} MiB, far more than a "
                    f"benchmark's prompts (its own take a few kB): split it, or give fewer "
                    f"prompts")), source)
        except OSError as e:
            raise InputError(f"{source} cannot be read: {e.strerror}") from None
        if path.suffix == ".json":
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InputError(f"--prompts {str(path)!r} is not valid JSON ({e})") from None
        else:
            data = {"custom": [line for line in raw.splitlines() if line.strip()]}
    prompts = [{"kind": k, "text": t} for k, texts in data.items() if isinstance(texts, list)
               for t in texts[:per_kind] if kind in ("all", k)]
    if not prompts:
        kinds = sorted(k for k, texts in data.items() if isinstance(texts, list) and texts)
        raise InputError(f"no prompts of kind {kind!r} found: use --kind all or one of {kinds}"
                         + ("" if path is not None else ", or give --prompts"))
    return prompts


def _quantiles(values) -> dict:
    v = np.asarray(values, dtype=float)
    return {"median": float(np.median(v)), "p25": float(np.percentile(v, 25)),
            "p75": float(np.percentile(v, 75)), "min": float(v.min()), "max": float(v.max())}


def _summarise(gamma, kind, pairs) -> dict:
    """One row of the report: `pairs` of (target-only stats, speculative stats, whether their
    tokens were identical: None where sampled) of one γ and prompt kind."""
    spec = [s for _, s, _ in pairs]
    base = [b for b, _, _ in pairs]
    # per-token costs from the runs themselves: a target step (target-only, after prefill), a
    # verify call (speculative, after prefill), a draft step
    step = sum(b.target_time_s for b in base) / max(1, sum(b.target_calls - 1 for b in base))
    verify = sum(s.target_time_s for s in spec) / max(1, sum(s.target_calls - 1 for s in spec))
    draft_steps = sum(s.draft_step_calls for s in spec)
    draft_step = sum(s.draft_step_time_s for s in spec) / draft_steps if draft_steps else 0.0
    positions = sum(s.alpha_positions for s in spec)
    alpha = sum(s.alpha * s.alpha_positions for s in spec) / positions if positions else 0.0
    c = draft_step / step if step > 0 else 0.0
    v = verify / step if step > 0 else 0.0
    mean_gamma = float(np.mean([s.mean_gamma for s in spec]))
    g = max(1, round(mean_gamma))
    new_tokens = sum(s.new_tokens for s in spec)
    target_calls = sum(s.target_calls for s in spec)
    identical = [same for _, _, same in pairs]
    return {
        "gamma": gamma,
        "kind": kind,
        "runs": len(pairs),
        "speculative_tokens_per_s": _quantiles([s.tokens_per_s for s in spec]),
        "target_only_tokens_per_s": _quantiles([b.tokens_per_s for b in base]),
        "speedup": _quantiles([s.tokens_per_s / b.tokens_per_s for b, s, _ in pairs]),
        "alpha": alpha,
        "acceptance_rate": sum(s.accepted for s in spec) / max(1, sum(s.proposed for s in spec)),
        "c": c,
        "verify_cost_ratio": v,
        "mean_gamma": mean_gamma,
        "tokens_per_target_call": new_tokens / max(1, target_calls),
        "predicted_speedup": expected_speedup(alpha, g, c),
        "predicted_speedup_with_verify_cost": expected_tokens_per_round(alpha, g) / (g * c + v)
        if v > 0 else 0.0,
        "loop_overhead": float(np.mean([s.loop_overhead for s in spec])),
        "new_tokens": new_tokens,
        "target_calls": target_calls,
        "target_step_ms": step * 1e3,
        "verify_call_ms": verify * 1e3,
        "draft_step_ms": draft_step * 1e3,
        # an encoder-decoder's encoders per request (both modes; speculative runs the draft's)
        "encode_ms": float(np.mean([s.encode_time_s for s in spec + base])) * 1e3,
        # greedy runs whose speculative tokens equal the target-only tokens (None: sampled)
        "identical": None if None in identical else sum(identical),
    }


def speech_prompts(gen, paths, language: str | None = None) -> list[dict]:
    """A speech bundle's bench inputs: each audio file (kind "speech"), with its language,
    detected once here where not given, so that every timed transcription runs its encoders
    (`_decode`)."""
    from ..speech import fixed_language

    return [{"kind": "speech", "audio": str(path),
             "language": fixed_language(gen, path, language)} for path in paths]


def _decode(gen, prompt: dict, options: GenerationOptions):
    """One timed generation: a text prompt's, or a speech input's transcription."""
    if "audio" in prompt:
        return gen.transcribe(prompt["audio"], replace(options, chat=None),
                              language=prompt.get("language"))
    return gen.generate(prompt["text"], options)


def run_bench(gen, prompts: list[dict], gammas: list, options: GenerationOptions | None = None,
              *, repeats: int = 1, progress: Callable[[int], None] | None = None,
              **values) -> dict:
    """Run every (γ, prompt, repeat) in both modes with `options` (or GenerationOptions(
    **values)): their max_new_tokens and sampling, greedy unless given; `chat` None applies
    the bundle's chat template when it has one. Returns the report (rows per γ and prompt
    kind, plus "all")."""
    options = GenerationOptions.given(options, values)
    if options.chat is None and gen.audio is None:
        options = replace(options, chat=bool(gen.chat_template))
    if options.temperature is None:  # greedy, whatever the bundle's default
        options = replace(options, temperature=0.0)
    temperature = options.temperature
    # warm-up: the first calls pay for allocations and ORT's lazy initialisation
    warm = replace(options, max_new_tokens=8, seed=0)
    _decode(gen, prompts[0], replace(warm, use_draft=False))
    _decode(gen, prompts[0], warm)
    rows = []
    for gamma in gammas:
        pairs: dict[str, list] = {}
        for i, prompt in enumerate(prompts):
            for rep in range(repeats):
                out, tokens = {}, {}
                order = (False, True) if (i + rep) % 2 == 0 else (True, False)
                for use_draft in order:
                    r = _decode(gen, prompt, replace(options, gamma=gamma,
                                                     use_draft=use_draft, seed=rep))
                    assert r.stats.new_tokens == len(r.tokens)
                    out[use_draft], tokens[use_draft] = r.stats, r.tokens
                # greedy: speculative output must be target-only output
                same = tokens[True] == tokens[False] if temperature == 0 else None
                pairs.setdefault(prompt["kind"], []).append((out[False], out[True], same))
                if progress:
                    progress(1)
        for kind, kind_pairs in pairs.items():
            rows.append(_summarise(gamma, kind, kind_pairs))
        if len(pairs) > 1:
            rows.append(_summarise(gamma, "all", [p for ps in pairs.values() for p in ps]))
    best = {}
    for row in rows:
        if row["kind"] not in best or row["speedup"]["median"] > best[row["kind"]]["speedup"]:
            best[row["kind"]] = {"gamma": row["gamma"], "speedup": row["speedup"]["median"]}
    return {
        "bundle": str(getattr(gen, "bundle_dir", "")),
        "draft": getattr(gen.draft, "kind", None),
        "temperature": temperature,
        "max_new_tokens": options.max_new_tokens,
        "repeats": repeats,
        "prompts": {k: sum(p["kind"] == k for p in prompts) for k in {p["kind"] for p in prompts}},
        "rows": rows,
        "best_gamma": best,
    }


def run_concurrent(gen, prompts: list[dict], gammas: list, options: GenerationOptions,
                   concurrency: int, *, repeats: int = 1,
                   progress: Callable[[int], None] | None = None) -> dict:
    """`specrun bench --concurrency N`: every prompt `repeats` times, N requests in flight
    (Generator.batch: one call of the target's lanes a round where the bundle has them),
    speculative and target-only alternately. Per γ and mode: the total tokens/s (all new tokens
    over the batch's wall time) and each request's ms per new token (p50, p95); greedy runs
    check that both modes' tokens are equal."""
    import time

    options = replace(options, chat=bool(gen.chat_template) if options.chat is None
                      else options.chat)
    if options.temperature is None:
        options = replace(options, temperature=0.0)
    texts = [p["text"] for p in prompts] * repeats
    warm = replace(options, max_new_tokens=8)
    list(gen.batch(texts[: concurrency], warm, concurrency=concurrency))
    rows = []
    for i, gamma in enumerate(gammas):
        measured, tokens = {}, {}
        for use_draft in ((False, True) if i % 2 == 0 else (True, False)):
            mode = replace(options, gamma=gamma, use_draft=use_draft)
            t0 = time.perf_counter()
            pieces = list(gen.batch(texts, mode, concurrency=concurrency))
            wall = time.perf_counter() - t0
            failed = [p.error for p in pieces if p.error is not None]
            if failed:
                raise failed[0]
            results = [p.result for p in sorted(pieces, key=lambda p: p.index)]
            new = sum(len(r.tokens) for r in results)
            per_token = [1e3 * r.stats.wall_time_s / len(r.tokens) for r in results
                         if r.tokens]
            measured[use_draft] = {"tokens_per_s": new / wall, "new_tokens": new, "wall_s": wall,
                                   "ms_per_token_p50": float(np.percentile(per_token, 50)),
                                   "ms_per_token_p95": float(np.percentile(per_token, 95))}
            tokens[use_draft] = [r.tokens for r in results]
            if progress:
                progress(len(texts))
        spec, base = measured[True], measured[False]
        rows.append({"gamma": gamma, "speculative": spec, "target_only": base,
                     "speedup": spec["tokens_per_s"] / base["tokens_per_s"],
                     "identical": tokens[True] == tokens[False]
                     if options.temperature == 0 else None})
    return {"bundle": str(getattr(gen, "bundle_dir", "")), "concurrency": concurrency,
            "max_batch": gen.max_batch, "requests": len(texts),
            "max_new_tokens": options.max_new_tokens, "temperature": options.temperature,
            "rows": rows}


def format_concurrent(report: dict) -> str:
    head = (f"{'γ':>5} {'spec tok/s':>10} {'base tok/s':>10} {'speedup':>8} "
            f"{'spec ms/tok p50/p95':>20} {'base ms/tok p50/p95':>20} {'= base':>6}")
    lines = [f"{report['requests']} requests, {report['concurrency']} in flight "
             f"(the bundle batches {report['max_batch']} a call)", head, "-" * len(head)]
    for r in report["rows"]:
        s, b = r["speculative"], r["target_only"]
        same = "-" if r["identical"] is None else str(r["identical"])
        lines.append(
            f"{str(r['gamma']):>5} {s['tokens_per_s']:>10.1f} {b['tokens_per_s']:>10.1f} "
            f"{r['speedup']:>7.2f}x "
            f"{s['ms_per_token_p50']:>9.1f} / {s['ms_per_token_p95']:>7.1f} "
            f"{b['ms_per_token_p50']:>9.1f} / {b['ms_per_token_p95']:>7.1f} {same:>6}")
    return "\n".join(lines)


def format_table(report: dict) -> str:
    head = (f"{'γ':>5} {'kind':>8} {'spec tok/s':>10} {'base tok/s':>10} {'speedup':>8} "
            f"{'pred':>6} {'α':>5} {'c':>6} {'verify/step':>11} {'tok/call':>8} {'overhead':>8} "
            f"{'= base':>6}")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        same = "-" if r.get("identical") is None else f"{r['identical']}/{r['runs']}"
        lines.append(
            f"{str(r['gamma']):>5} {r['kind']:>8} {r['speculative_tokens_per_s']['median']:>10.1f} "
            f"{r['target_only_tokens_per_s']['median']:>10.1f} {r['speedup']['median']:>7.2f}x "
            f"{r['predicted_speedup']:>5.2f}x {r['alpha']:>5.2f} {r['c']:>6.3f} "
            f"{r['verify_cost_ratio']:>11.2f} {r['tokens_per_target_call']:>8.2f} "
            f"{100 * r['loop_overhead']:>7.1f}% {same:>6}"
        )
    best = ", ".join(f"{k}: γ={v['gamma']} ({v['speedup']:.2f}x)"
                     for k, v in report["best_gamma"].items())
    lines.append(f"best γ — {best}")
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """Speedup vs γ, measured (median, p25–p75 bars) and predicted by the paper's formula."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    kinds = sorted({r["kind"] for r in report["rows"]})
    for i, kind in enumerate(kinds):
        rows = [r for r in report["rows"] if r["kind"] == kind and r["gamma"] != "auto"]
        if not rows:
            continue
        g = [r["gamma"] for r in rows]
        med = [r["speedup"]["median"] for r in rows]
        err = [[m - r["speedup"]["p25"] for m, r in zip(med, rows)],
               [r["speedup"]["p75"] - m for m, r in zip(med, rows)]]
        color = f"C{i}"
        ax.errorbar(g, med, yerr=err, marker="o", color=color, capsize=3,
                    label=f"{kind}: measured")
        ax.plot(g, [r["predicted_speedup"] for r in rows], "--", color=color,
                label=f"{kind}: predicted (α, c)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("γ (draft tokens per round)")
    ax.set_ylabel("speedup over target-only")
    ax.set_title(f"draftproof bench — draft: {report['draft']}, T={report['temperature']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
