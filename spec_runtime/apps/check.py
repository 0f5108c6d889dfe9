"""`specrun check`: an exactness test a user runs on their own bundle, on its own graphs.

Speculative decoding is exact when its output has the target's distribution. This module
compares the two modes of the same `Generator` (speculative, and target-only with
`use_draft=False`), which share every engine, so anything that differs between them is the
draft-and-verify machinery: the draft's q, the acceptance test, the residual, the cache rollback.

1. Sampling: N continuations of k tokens drawn each way at the given setting (temperature 1 by
   default), alternating, with independent seeds, from a few built-in prompts on which the
   draft does propose (repetitive text, so even a prompt-lookup draft is exercised). The joint
   distribution of the k tokens is compared by a two-sample chi-square, stratified by prompt,
   sparse cells pooled into shorter prefixes (see twosample.py). Reported: p-value, total
   variation on the pooled cells with its noise floor, and the smallest TV the test detects.
2. Greedy parity: speculative greedy must equal target-only greedy token for token. Where the
   load found that the target scores a position bit for bit alike in a step and in a verify
   call (rows.py: the usual case), any divergence is a failure. Where it found them different
   (kernels of this machine that no call form reconciles), a numerically near-tied argmax may
   legitimately flip: a first divergence whose target logit gap is below NEAR_TIE (relative)
   is then a warning, any other divergence a failure.

What it cannot see: a bug that also affects target-only decoding (both modes share the
engines: a wrong graph is `specexport verify`'s business), differences smaller than the
reported detectable TV, differences hidden inside pooled cells or beyond the first k tokens, and
settings other than the one checked.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ..errors import FieldError, InputError
from ..request import GenerationOptions
from ..engines.rows import RowCheck
from ..decode.sampling import SAMPLING_FIELDS
from .twosample import compare

LEVEL = 1e-3  # p-value below which the sampling test rejects
POWER = 0.9  # power at which the detectable TV is reported
NEAR_TIE = 1e-4  # relative logit gap below which a greedy divergence is a near-tie
DEFAULT_SAMPLES = 400  # per mode (README, "Check exactness": what this takes and detects)
DEFAULT_SECONDS = None  # no time limit: the defaults draw all their samples
DEFAULT_TOKENS = 3
GREEDY_TOKENS = 24

PROMPTS = (
    "one two three four, one two three four, one two three four, one two",
    "red green blue, red green blue, red green blue, red green",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
)


def _positive(name: str, value, kind=int):
    types = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, types) or not value > 0:
        raise InputError(f"{name} {value!r} is invalid: use a {kind.__name__} > 0")
    return value


def first_divergence(gen, request, spec: list[int], base: list[int]) -> dict | None:
    """Where speculative greedy output first differs from target-only greedy output (of
    `request`, a Request), with the target's logit gap between the two tokens there."""
    n = min(len(spec), len(base))
    i = next((j for j in range(n) if spec[j] != base[j]), None)
    if i is None:
        if len(spec) == len(base):
            return None
        i = n  # one stopped earlier (EOS): the EOS itself is the differing token
    if i >= len(spec) or i >= len(base):
        return {"index": i, "target_token": base[i] if i < len(base) else None,
                "speculative_token": spec[i] if i < len(spec) else None,
                "logit_gap": None, "relative_gap": None, "near_tie": False}
    start = request.prefix if gen.encoder_decoder else None
    logits = gen.target_logits(request.prompt, base[:i], start=start)
    la, lb = float(logits[base[i]]), float(logits[spec[i]])
    rel = abs(la - lb) / max(1.0, abs(la), abs(lb))
    return {"index": i, "target_token": base[i], "speculative_token": spec[i],
            "logit_gap": la - lb, "relative_gap": rel, "near_tie": rel < NEAR_TIE}


# greedy parity compares plain greedy decoding: every context-dependent control off, whatever
# the bundle's generation defaults say
# every sampling control off: the setting the sampling test fills in where it is not given
# (at temperature 1), and the greedy test's (at temperature 0)
OFF = {f.name: f.default for f in SAMPLING_FIELDS if f.name not in ("seed", "logit_bias")}
GREEDY = {**OFF, "temperature": 0.0}
SETTING = {**OFF, "temperature": 1.0}


def _inputs(gen, prompts, audio) -> list[tuple[str, object]]:
    """(label, make) per input: make(options) is its Request on `gen`, a text prompt's or,
    for a speech bundle, an audio input's (its language fixed once)."""
    if gen.audio is None:
        if audio:
            raise InputError("audio is a speech bundle's input, and this bundle is a text "
                             "model: check it on prompts")
        ids = [[int(t) for t in gen.tokenize(p)] for p in prompts]
        return [(text, lambda o, p=p: gen.request(p, o)) for text, p in zip(prompts, ids)]
    from ..speech import check_signals, fixed_language

    sources = [(str(a), a) for a in audio] if audio else \
        check_signals(gen.window_seconds)
    out = []
    for label, source in sources:
        lang = fixed_language(gen, source)
        out.append((label, lambda o, s=source, lang=lang: gen.transcription(s, o, language=lang)))
    return out


def run_check(gen, options: GenerationOptions | None = None, *, tokens: int = DEFAULT_TOKENS,
              samples: int = DEFAULT_SAMPLES, seconds: float | None = DEFAULT_SECONDS,
              greedy_tokens: int = GREEDY_TOKENS, seed: int = 0, prompts=PROMPTS,
              audio=(), progress=None, clock=time.monotonic, **values) -> dict:
    """Run both tests and return the report (a dict; `exit_code` 0 consistent, 1 not).
    `options` (or GenerationOptions(**values)): the sampling setting checked and γ. The
    sampling test runs at exactly that setting, a control left unset being off (SETTING:
    temperature 1; the bundle's generation defaults do not apply). `seconds`, when given,
    bounds the whole run on `clock`: sampling stops when it is spent. The report carries what
    the load found of the target's rows (rows.py). A speech bundle is checked on `audio`
    (paths or samples), else on speech.check_signals: what is said does not matter here."""
    _positive("--tokens", tokens)
    _positive("--samples", samples)
    if seconds is not None:
        _positive("--seconds", seconds, float)
    _positive("--greedy-tokens", greedy_tokens)
    options = GenerationOptions.given(options, values)
    given = {k: v for k, v in options.sampling().items() if v is not None and k != "seed"}
    setting = {**SETTING, **given}
    if setting["temperature"] == 0:
        raise FieldError("temperature", "temperature=0 is greedy, which the greedy parity test "
                                        "covers: check sampling at a temperature > 0")
    gamma = options.gamma
    # every value, γ and the cache's room checked before minutes of sampling
    options = replace(options, max_new_tokens=max(tokens, greedy_tokens), **setting)
    greedy_options = replace(options, max_new_tokens=greedy_tokens, **GREEDY)
    start = clock()
    deadline = start + seconds if seconds is not None else float("inf")
    inputs = _inputs(gen, prompts, audio)
    for _, make in inputs:
        make(options)
    prompts = [label for label, _ in inputs]
    warnings: list[str] = []

    # 1. greedy parity
    row_check = getattr(gen, "row_check", None)
    ties_flip = not (row_check and row_check.identical)  # rows may round differently
    greedy = []
    for text, make in inputs:
        spec = gen.generate(make(greedy_options)).tokens
        base = gen.generate(make(replace(greedy_options, use_draft=False))).tokens
        div = first_divergence(gen, make(greedy_options), spec, base)
        if div is not None:
            div["near_tie"] = div["near_tie"] and ties_flip
        greedy.append({"prompt": text, "identical": div is None, "divergence": div})
        if div is not None and div["near_tie"]:
            warnings.append(f"greedy outputs differ at token {div['index']} of {text[:24]!r}... "
                            f"where the target's logits are near-tied (relative gap "
                            f"{div['relative_gap']:.1e} < {NEAR_TIE:g}): the verify call and "
                            f"the 1-token call round differently; not counted as a failure")
    greedy_ok = all(g["identical"] or g["divergence"]["near_tie"] for g in greedy)

    # 2. sampling: alternate the modes so that a time limit leaves equal sample sizes
    seeds = np.random.default_rng(seed)  # one independent seed per generation
    drawn_spec = [[] for _ in prompts]
    drawn_base = [[] for _ in prompts]
    proposed = accepted = drawn = 0
    t0 = clock()
    for i in range(samples):
        if clock() > deadline:
            break
        j = i % len(prompts)
        make = inputs[j][1]
        s = gen.generate(make(replace(options, max_new_tokens=tokens,
                                      seed=int(seeds.integers(2**62)))))
        b = gen.generate(make(replace(options, max_new_tokens=tokens, use_draft=False,
                                      seed=int(seeds.integers(2**62)))))
        drawn_spec[j].append(tuple(s.tokens))
        drawn_base[j].append(tuple(b.tokens))
        proposed += s.stats.proposed
        accepted += s.stats.accepted
        drawn += 1
        if progress is not None:
            progress(1)
    result = compare(list(zip(drawn_spec, drawn_base)), LEVEL, POWER, seed=seed)
    if drawn < samples and result["min_detectable_tv"] is not None:
        # the detectable TV shrinks about as 1/sqrt(N) (README, "Check exactness")
        full = result["min_detectable_tv"] * (drawn / samples) ** 0.5
        warnings.append(f"--seconds {seconds:g} ran out after {drawn} of {samples} samples per "
                        f"mode: the test is weaker than asked (it detects a TV of "
                        f"{result['min_detectable_tv']:.2f} or more, where all {samples} would "
                        f"detect about {full:.2f}); raise --seconds, or leave it out to draw "
                        f"them all")
    elif drawn < samples:
        warnings.append(f"--seconds {seconds:g} ran out after {drawn} of {samples} samples per "
                        f"mode; raise --seconds, or leave it out to draw them all")
    if proposed == 0:
        warnings.append("the draft proposed no token: the verify path was not exercised")
    if result["p_value"] is None:
        warnings.append("too few samples for a chi-square test (no two cells with >= 10 draws); "
                        "raise --samples or --seconds")
    sampling_ok = result["p_value"] is None or result["p_value"] >= LEVEL
    consistent = sampling_ok and greedy_ok
    return {
        "bundle": str(getattr(gen, "bundle_dir", "")),
        "draft": getattr(gen.draft, "kind", None),
        "gamma": gamma if gamma is not None else gen.default_gamma,
        "sampling": {
            "setting": setting, "tokens": tokens, "prompts": len(prompts), "requested": samples,
            "drawn": drawn, "seconds": clock() - t0, "level": LEVEL, "power": POWER,
            "draft_proposed": proposed, "draft_accepted": accepted, "passed": sampling_ok,
            **result,
        },
        "greedy": {"tokens": greedy_tokens, "prompts": greedy, "passed": greedy_ok},
        "rows": row_check.to_dict() if row_check else None,
        "warnings": warnings,
        "seconds": clock() - start,
        "consistent": consistent,
        "exit_code": 0 if consistent else 1,
    }


def _tv_words(s: dict) -> str:
    """What a TV above its noise floor's 95th percentile means beside the chi-square's verdict:
    the TV is a size, read against the noise of two samples of this size; it exceeds that
    percentile by chance in 1 run of 20, and the test, which weighs each cell by its count,
    decides."""
    if s["tv"] <= s["tv_noise_p95"]:
        return ""
    return ("; above the 95th percentile, as by chance in 1 run of 20: the chi-square, which "
            "weighs each cell by its count, is the test" if s["passed"] else
            "; above the 95th percentile, as the chi-square found")


def format_report(r: dict) -> str:
    s, g = r["sampling"], r["greedy"]
    setting = ", ".join(f"{k} {v}" for k, v in s["setting"].items()
                        if v != GREEDY.get(k) or k == "temperature")
    lines = [f"specrun check {r['bundle']}  (draft {r['draft']}, γ {r['gamma']})", "",
             f"sampling   {setting}; first {s['tokens']} tokens of {s['prompts']} prompts",
             f"  drawn    {s['drawn']} speculative + {s['drawn']} target-only "
             f"(of {s['requested']}) in {s['seconds']:.1f} s; draft tokens accepted "
             f"{s['draft_accepted']}/{s['draft_proposed']}"]
    if s["p_value"] is None:
        lines.append("  test     inconclusive: too few samples")
    else:
        lines += [
            f"  chi2     {s['chi2']:.1f} on {s['df']} df ({s['cells']} cells) -> p = "
            f"{s['p_value']:.3g}  ({'below' if not s['passed'] else 'not below'} "
            f"{s['level']:g}: {'rejects' if not s['passed'] else 'consistent'})",
            f"  TV       {s['tv']:.3f}  (noise floor at this N: mean {s['tv_noise_floor']:.3f}, "
            f"95th percentile {s['tv_noise_p95']:.3f}){_tv_words(s)}",
            f"  power    detects a TV >= {s['min_detectable_tv']:.3f} on these cells with "
            f"{s['power']:.0%} probability at level {s['level']:g}",
        ]
    same = sum(p["identical"] for p in g["prompts"])
    lines.append(f"greedy     {same}/{len(g['prompts'])} prompts identical over "
                 f"{g['tokens']} tokens")
    for p in g["prompts"]:
        d = p["divergence"]
        if d is not None:
            gap = "n/a" if d["relative_gap"] is None else f"{d['relative_gap']:.1e}"
            lines.append(f"  differs  at token {d['index']} of {p['prompt'][:32]!r}: target "
                         f"{d['target_token']} vs speculative {d['speculative_token']}, relative "
                         f"logit gap {gap} ({'near-tie' if d['near_tie'] else 'FAILURE'})")
    if r.get("rows"):
        lines.append(f"rows       {RowCheck(**r['rows']).describe()}")
    lines += [f"warning    {w}" for w in r["warnings"]]
    lines.append(f"time       {r['seconds']:.1f} s")
    lines.append("verdict    " + ("consistent: no evidence that speculative decoding departs from "
                                  "the target's distribution" if r["consistent"] else
                                  "INCONSISTENT: speculative decoding departs from the target"))
    return "\n".join(lines)
