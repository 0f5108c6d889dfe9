"""Pure-numpy sampling for speculative decoding.

Works on logits and probabilities only, never on engines or requests, and every random draw comes
from a `numpy.random.Generator` passed in by the caller. Names: `p_target` is the target model's
distribution, `p_draft` the draft's (the paper calls them p and q).

The one function that turns logits into the distribution that is sampled is `warp`; draft and
target go through it with the same `SamplingParams`, so the q the acceptance test divides by is
exactly the q the draft token was drawn from.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import FieldError, NonFiniteLogitsError

# A residual max(0, p_target - p_draft) whose mass is below this is floating-point noise left by
# p_target ~= p_draft; sampling it would amplify rounding error into a wrong distribution.
RESIDUAL_EPS = 1e-9


TOP_P_EPS = 1e-9


def _check_finite(logits: np.ndarray) -> np.ndarray:
    """Row maxima of logits [..., V]; raises if any row holds NaN or +inf, or only -inf."""
    row_max = logits.max(axis=-1)
    if not np.all(np.isfinite(row_max)):
        raise NonFiniteLogitsError(
            "logits contain NaN or +inf (or a row is all -inf): the exported graph or its inputs "
            "are corrupt; re-run `specexport build` and `specexport verify`"
        )
    return row_max


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _show(x) -> str:
    return repr(x.item() if isinstance(x, np.generic) else x)


def _control(what: str, range_: str, off: str, *, check, bundle: bool = False,
             openai: bool = False, cli: str | None = None) -> dict:
    """A sampling control's declaration, as the metadata of its SamplingParams field: what it
    does, its range and its value when off (the CLI's help, the docs' table), the function that
    checks a value (-> the Python value, or FieldError naming it), whether a model's
    generation_config may set it (a bundle default) and whether the OpenAI API has it (else it
    is one of our documented extensions). `cli`: the option's help where it says more."""
    return {"what": what, "range": range_, "off": off, "check": check, "bundle": bundle,
            "openai": openai, "cli": cli or what}


def _temperature(t):
    if not _real(t) or not math.isfinite(t) or t < 0:
        raise FieldError("temperature", f"temperature={_show(t)} is invalid: use a finite "
                                        f"number >= 0 (0 = greedy)")
    return float(t)


def _top_k(k):
    if not _integer(k) or k < 0:
        raise FieldError("top_k", f"top_k={_show(k)} is invalid: use an integer >= 0 (0 = no "
                                  f"top-k)")
    return int(k)


def _top_p(p):
    if not _real(p) or not (0.0 < p <= 1.0):
        raise FieldError("top_p", f"top_p={_show(p)} is invalid: use a number in (0, 1] (1 = "
                                  f"no top-p)")
    return float(p)


def _min_p(m):
    if not _real(m) or not (0.0 <= m <= 1.0):
        raise FieldError("min_p", f"min_p={_show(m)} is invalid: use a number in [0, 1] (0 = "
                                  f"no min-p)")
    return float(m)


def _repetition_penalty(r):
    if not _real(r) or not math.isfinite(r) or r <= 0:
        raise FieldError("repetition_penalty", f"repetition_penalty={_show(r)} is invalid: use "
                                               f"a number > 0 (1 = none; 1.1-1.3 is typical)")
    return float(r)


def _penalty(name):
    def check(v):
        if not _real(v) or not -2.0 <= v <= 2.0:
            raise FieldError(name, f"{name}={_show(v)} is invalid: use a number in [-2, 2] "
                                   f"(0 = none)")
        return float(v)
    return check


def _seed(s):
    if s is None:
        return None
    if not _integer(s) or s < 0:
        raise FieldError("seed", f"seed={_show(s)} is invalid: use a non-negative integer, or "
                                 f"leave it out for a random seed")
    return int(s)


def _penalty_start(start):
    if not _integer(start) or start < 0:
        raise FieldError("penalty_start", f"penalty_start={_show(start)} is invalid: use an "
                                          f"integer >= 0")
    return int(start)


@dataclass(frozen=True)
class SamplingParams:
    """How logits become the distribution that is sampled, in this order (Hugging Face's order,
    with OpenAI's penalties beside its repetition penalty):

    1. logit_bias {token id: bias} is added to the logits (OpenAI's `logit_bias`, -100..100);
    2. repetition_penalty divides a positive logit and multiplies a negative one of every token
       in the context, prompt included (Hugging Face's and vLLM's `repetition_penalty`; 1 = off);
    3. frequency_penalty × (times the token was generated) + presence_penalty × (1 if it was)
       is subtracted (OpenAI's penalties, -2..2; they count generated tokens, i.e. the context
       from `penalty_start` on, which a request sets to its prompt's length);
    4. temperature (0 = greedy: the distribution is one-hot at the argmax of the logits after
       1-3), then top-k, top-p and min-p truncation (0, 1.0 and 0 disable them).

    Before them, a `constraint` (constraint.py: a response_format's grammar) sets the logits of
    the tokens it does not allow after the generated tokens to -inf. Steps 0-3 read the context
    of each position, so `warp` takes the tokens before it.

    The fields with a `_control` are the sampling controls a request sets, declared here once:
    GenerationOptions, the CLI's options, the OpenAI API's fields, the bundle's
    generation_config keys and the docs' table are made from SAMPLING_FIELDS.
    """

    temperature: float = field(default=0.0, metadata=_control(
        "divides the logits; 0 = greedy (argmax)", "≥ 0", "0", check=_temperature, bundle=True,
        openai=True, cli="sampling temperature, >= 0; 0 = greedy"))
    top_k: int = field(default=0, metadata=_control(
        "keeps the k most likely tokens; 0 = all", "≥ 0", "0", check=_top_k, bundle=True,
        cli="keep the k most likely tokens, >= 0; 0 = all"))
    top_p: float = field(default=1.0, metadata=_control(
        "keeps the most likely tokens up to this mass", "(0, 1]", "1", check=_top_p,
        bundle=True, openai=True,
        cli="keep the most likely tokens up to this probability mass, in (0, 1]"))
    seed: int | None = field(default=None, metadata=_control(
        "fixes the random draws", "≥ 0", "random", check=_seed, openai=True,
        cli="random seed, >= 0: the same seed gives the same sample in the same mode "
            "(speculative and --no-draft draw differently)"))
    min_p: float = field(default=0.0, metadata=_control(
        "drops tokens less likely than min-p × the most likely", "[0, 1]", "0", check=_min_p,
        bundle=True,
        cli="drop tokens less likely than min-p × the most likely one, in [0, 1]"))
    repetition_penalty: float = field(default=1.0, metadata=_control(
        "divides positive (multiplies negative) logits of tokens in the context, prompt "
        "included, as Hugging Face's does", "> 0", "1", check=_repetition_penalty, bundle=True,
        cli="divide the logits of tokens already in the context (prompt included), > 0; "
            "1.1-1.3 curbs loops"))
    presence_penalty: float = field(default=0.0, metadata=_control(
        "subtracts from the logit of every token generated so far (OpenAI API)", "[−2, 2]", "0",
        check=_penalty("presence_penalty"), openai=True,
        cli="subtract from the logit of every token generated so far, in [-2, 2]"))
    frequency_penalty: float = field(default=0.0, metadata=_control(
        "subtracts this × each token's count in the generated text (OpenAI API)", "[−2, 2]",
        "0", check=_penalty("frequency_penalty"), openai=True,
        cli="subtract this × how often a token was generated so far, in [-2, 2]"))
    # a dict {token id: bias} is accepted and converted
    logit_bias: tuple[tuple[int, float], ...] | None = field(default=None, metadata=_control(
        "adds BIAS to token ID's logit; −100 bans it", "[−100, 100]", "none",
        check=lambda bias: _logit_bias(bias), openai=True,
        cli="add BIAS (in [-100, 100]) to token ID's logit; repeatable; -100 bans a token"))
    penalty_start: int = field(default=0, metadata={"check": _penalty_start})
    # constraint.Constraint (response_format): tokens it does not allow after the generated
    # ones get -inf first; one request's state, never compared
    constraint: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "constraint"}
        for name, value in check_sampling(values).items():
            object.__setattr__(self, name, value)

    @classmethod
    def checked(cls, **values) -> "SamplingParams":
        """SamplingParams of values already checked (check_sampling: GenerationOptions and the
        manifest's generation defaults), not checked again."""
        params = object.__new__(cls)
        for f in fields(cls):
            object.__setattr__(params, f.name, values.get(f.name, f.default))
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_context(self) -> bool:
        """Whether the distribution at a position depends on the tokens before it (steps 1-3:
        logit_bias does not, but it goes through the same function)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 \
            or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.constraint is not None


# the sampling controls a request sets, as SamplingParams declares them (dataclasses.Field,
# their metadata from _control), in its order; and those a model's generation_config may set
SAMPLING_FIELDS = tuple(f for f in fields(SamplingParams) if "what" in f.metadata)
SAMPLING_NAMES = tuple(f.name for f in SAMPLING_FIELDS)
GENERATION_CONFIG_KEYS = tuple(f.name for f in SAMPLING_FIELDS if f.metadata["bundle"])
_CHECKS = {f.name: f.metadata["check"] for f in fields(SamplingParams) if "check" in f.metadata}


def check_sampling(values: dict) -> dict:
    """SamplingParams' fields in `values` (any subset; a None seed is no seed), checked in the
    order given and returned as Python numbers (numpy scalars such as np.float32(0.5) are
    numbers like any other, but a message or a comparison should never show a numpy type, and
    logit_bias becomes sorted pairs); FieldError naming the first bad value and the range it
    must be in. What SamplingParams and a request's options (request.GenerationOptions) check."""
    return {name: _CHECKS[name](value) if name in _CHECKS else value
            for name, value in values.items()}


def sampling_table() -> str:
    """The sampling controls as the docs' markdown table (a test holds the docs to it)."""
    rows = ["| CLI | Python | range | default | what it does |", "|---|---|---|---|---|"]
    for f in SAMPLING_FIELDS:
        m = f.metadata
        cli, python = f"`{cli_flag(f.name)}`", f"`{f.name}`"
        if f.name == "logit_bias":
            cli, python = "`--logit-bias ID=BIAS`", "`logit_bias={id: bias}`"
        default = f"bundle, else {m['off']}" if m["bundle"] else m["off"]
        rows.append(f"| {cli} | {python} | {m['range']} | {default} | {m['what']} |")
    return "\n".join(rows)


def cli_flag(name: str) -> str:
    """A request field's command-line option: its name with dashes (`top_p` -> `--top-p`)."""
    return "--" + name.replace("_", "-")


# a token id is an int64 (numpy's ids): a key past it is in no vocabulary, and one of more than
# 4,300 digits Python will not even read (int() raises ValueError), so longer keys are refused
# by their length, unread
_MAX_ID = 2 ** 63 - 1
_ID_DIGITS = len(str(_MAX_ID))


def _digit_count(n: int) -> int:
    """Decimal digits of n >= 0, without str(n) (refused past 4,300 digits)."""
    d = int(n.bit_length() * 0.30103) + 1  # log10(2): at most one too many
    while d > 1 and 10 ** (d - 1) > n:
        d -= 1
    return d


def _shown_id(x) -> str:
    """A key or bias too large for any vocabulary or range, shortened: its first digits and
    how many there are (a message holds a line, not 5,000 digits)."""
    if isinstance(x, str):
        head, n, sign = x[:12], len(x), ""
    else:
        n, sign = _digit_count(abs(x)), "-" if x < 0 else ""
        head = str(abs(x) // 10 ** max(n - 12, 0))
    return f"{sign}{head}{'...' if n > 12 else ''} ({n} digits)"


def _logit_bias(bias) -> tuple[tuple[int, float], ...] | None:
    """{token id: bias} (or pairs) -> sorted ((id, bias), ...), None when empty."""
    if bias is None:
        return None
    if isinstance(bias, dict):
        items = list(bias.items())
    else:
        try:
            items = [tuple(pair) for pair in bias]
        except TypeError:
            items = None
        if items is None or any(len(pair) != 2 for pair in items):
            try:
                shown = repr(bias)
            except ValueError:  # it holds an int of more than 4,300 digits
                shown = f"<a {type(bias).__name__}>"
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise FieldError("logit_bias", f"logit_bias={shown} is invalid: use a dict "
                                           f"{{token id: bias}}")
    out = {}
    for tok, b in items:
        # numpy scalars as Python numbers: uint64 reaches past int64, and the size checks and
        # the shortened messages below need Python's unbounded ints
        tok = tok.item() if isinstance(tok, np.generic) else tok
        b = b.item() if isinstance(b, np.generic) else b
        digits = isinstance(tok, str) and tok.isascii() and tok.isdigit()
        if digits and len(tok) <= _ID_DIGITS:
            tok, digits = int(tok), False  # JSON object keys are strings (OpenAI's API sends
            # them so); only the plain decimal spelling: int() would also read " 5" and "٥"
        if digits or _integer(tok) and tok > _MAX_ID:
            raise FieldError("logit_bias", f"logit_bias token id {_shown_id(tok)} is beyond any "
                                           f"vocabulary: use a token id within the model's "
                                           f"vocabulary (an integer >= 0, below its size)")
        if not _integer(tok) or tok < 0:
            shown = _shown_id(tok) if _integer(tok) and tok < -_MAX_ID else _show(tok)
            raise FieldError("logit_bias", f"logit_bias token id {shown} is invalid: use a "
                                           f"token id (an integer >= 0)")
        if not _real(b) or not -100.0 <= b <= 100.0:
            shown = _shown_id(b) if _integer(b) and abs(b) > _MAX_ID else _show(b)
            raise FieldError("logit_bias", f"logit_bias[{tok}]={shown} is invalid: use a number "
                                           f"in [-100, 100] (-100 bans the token, 100 all but "
                                           f"forces it)")
        out[int(tok)] = float(b)
    return tuple(sorted(out.items())) or None


def penalize(logits: np.ndarray, params: SamplingParams, tokens=None, appended=None) -> np.ndarray:
    """Steps 1-3 of SamplingParams: logits [V] or [R, V] -> float64 logits of the same shape.
    Row r's context is `tokens` followed by appended[:r] (a verify call's rows see the draft
    tokens before them); ids at or beyond V (another model's padding) are ignored."""
    x = np.array(logits, dtype=np.float64)  # a copy
    rows = x.reshape(-1, x.shape[-1])
    vocab = rows.shape[-1]
    if params.constraint is not None:
        _mask(rows, params, tokens, appended)
    if params.logit_bias:
        ids = np.array([t for t, _ in params.logit_bias], np.int64)
        bias = np.array([b for _, b in params.logit_bias])
        inside = ids < vocab
        rows[:, ids[inside]] += bias[inside]
    if not (params.repetition_penalty != 1.0 or params.presence_penalty
            or params.frequency_penalty):
        return x
    if tokens is None:
        raise ValueError("these sampling parameters read the context: pass the tokens before "
                         "the first row")
    tokens = np.asarray(tokens, np.int64)
    appended = np.zeros(0, np.int64) if appended is None else np.asarray(appended, np.int64)
    if len(appended) < len(rows) - 1:
        raise ValueError(f"{len(rows)} rows need {len(rows) - 1} appended tokens, got "
                         f"{len(appended)}")
    start = min(params.penalty_start, len(tokens))
    for r, row in enumerate(rows):
        context = np.concatenate([tokens, appended[:r]])
        context = context[context < vocab]
        if params.repetition_penalty != 1.0:
            seen = np.unique(context)
            v = row[seen]
            row[seen] = np.where(v < 0, v * params.repetition_penalty,
                                 v / params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            generated = np.concatenate([tokens[start:], appended[:r]])
            ids, counts = np.unique(generated[generated < vocab], return_counts=True)
            row[ids] -= counts * params.frequency_penalty + params.presence_penalty
    return x


def _mask(rows: np.ndarray, params: SamplingParams, tokens, appended) -> None:
    """Step 0, in place: -inf for the tokens the constraint does not allow after the tokens
    generated before each row (the context from `penalty_start` on, then appended[:r]); then
    the constraint's `rule`, where it has one, on the masked row (in place: Whisper's timestamp
    rule reads the row's probabilities, speech.Timestamps)."""
    if tokens is None:
        raise ValueError("a constraint reads the context: pass the tokens before the first row")
    tokens = np.asarray(tokens, np.int64)
    appended = np.zeros(0, np.int64) if appended is None else np.asarray(appended, np.int64)
    generated = tokens[min(params.penalty_start, len(tokens)):]
    rule = getattr(params.constraint, "rule", None)
    for r, row in enumerate(rows):
        allowed = params.constraint.allowed(np.concatenate([generated, appended[:r]]))
        if allowed is not None:
            n = min(len(allowed), len(row))  # ids past the mask (padding) are never allowed
            row[:n][~allowed[:n]] = -np.inf
            row[n:] = -np.inf
            if rule is not None:  # what the constraint decides from the masked row itself
                rule(row)


def warp(logits: np.ndarray, params: SamplingParams, tokens=None, appended=None) -> np.ndarray:
    """Logits [..., V] -> float64 probabilities [..., V]: `penalize` (for parameters that read
    the context: `tokens` before the first row, `appended` between rows), then temperature,
    top-k, top-p and min-p.

    The order and the tie rules follow Hugging Face's warpers: top-k keeps every token tied with
    the k-th largest logit; top-p keeps the smallest set of most likely tokens whose mass reaches
    top_p (always at least one); min-p keeps the tokens whose probability is at least min_p
    times the largest.
    """
    logits = np.asarray(logits)
    _check_finite(logits)
    if params.reads_context:
        logits = penalize(logits, params, tokens, appended)
    row_max = logits.max(axis=-1)[..., None]
    if params.greedy:
        probs = np.zeros(logits.shape, dtype=np.float64)
        np.put_along_axis(probs, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return probs

    with np.errstate(over="ignore"):  # a tiny temperature sends all but the maximum to -inf
        x = (logits.astype(np.float64) - row_max) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
        # mass within TOP_P_EPS of top_p counts as reaching it, so that 0.5 + 0.3 reaches 0.8
        # whatever the rounding; the first token (mass_before 0) is always kept
        keep_sorted = mass_before < params.top_p - TOP_P_EPS
        keep_sorted[..., 0] = True  # also when top_p <= TOP_P_EPS
        keep = np.zeros(probs.shape, dtype=bool)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    if params.min_p > 0.0:
        # the largest probability always survives (min_p <= 1)
        probs = np.where(probs >= params.min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector [V] (need not be normalised) by inverse CDF."""
    cdf = np.cumsum(probs)
    total = cdf[-1]
    if not (total > 0 and math.isfinite(total)):
        raise NonFiniteLogitsError(f"cannot sample from a distribution with total mass {total!r}")
    idx = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    if idx >= len(cdf):  # r * total rounded up to total: the last token with mass, never a zero
        idx = int(np.flatnonzero(np.asarray(probs) > 0)[-1])
    return idx


def _pad_vocab(a: np.ndarray, vocab: int) -> np.ndarray:
    # Vocabularies padded to different sizes (e.g. 49152 vs 49280) are aligned by zero mass on
    # the padding ids, never by truncating the larger one.
    if a.shape[-1] == vocab:
        return a
    return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, vocab - a.shape[-1])])


def accept_drafts(
    draft_tokens: np.ndarray,
    p_draft: np.ndarray | None,
    p_target: np.ndarray,
    rng: np.random.Generator,
) -> list[int]:
    """Leviathan et al. 2023, Algorithm 1, the acceptance step.

    draft_tokens [γ], p_draft [γ, V], p_target [γ+1, V]. Returns the accepted prefix of the
    draft followed by exactly one token: drawn from norm(max(0, p_target - p_draft)) at the first
    rejection, or from p_target[γ] when all γ are accepted. Each returned token is distributed as
    if sampled from p_target given the tokens before it (the paper's Theorem 3.5).

    p_draft None: every draft token was proposed with certainty, q one-hot at it (a lookup
    draft; vLLM passes draft_probs=None for its n-gram proposer the same way). The test then
    reads p_target(x) alone: accept with probability p_target(x), and on rejection the residual
    max(0, p_target - q) is p_target with x removed, renormalised: `_accept_one_hot`, the same
    tokens as the dense rows would give for the same random draws, without building them.
    """
    gamma = len(draft_tokens)
    p_target = np.asarray(p_target)
    if p_target.ndim != 2 or p_target.shape[0] != gamma + 1:
        raise ValueError(f"p_target has shape {p_target.shape}; it needs γ+1 = {gamma + 1} rows")
    if p_draft is None:
        return _accept_one_hot(draft_tokens, p_target, rng)
    p_draft = np.asarray(p_draft)
    if p_draft.ndim != 2 or p_draft.shape[0] != gamma:
        raise ValueError(f"p_draft has shape {p_draft.shape}; it needs γ = {gamma} rows")
    vocab = max(p_target.shape[-1], p_draft.shape[-1])
    p_target, p_draft = _pad_vocab(p_target, vocab), _pad_vocab(p_draft, vocab)

    out: list[int] = []
    for i in range(gamma):
        x = int(draft_tokens[i])
        # Accept with probability min(1, p/q), written as r*q < p so that q = 0 needs no division.
        if rng.random() * p_draft[i, x] < p_target[i, x]:
            out.append(x)
            continue
        residual = np.maximum(p_target[i] - p_draft[i], 0.0)
        if residual.sum() <= RESIDUAL_EPS:
            # p_target ~= p_draft up to rounding: the residual is noise, and the exact
            # distribution to fall back on is p_target itself.
            residual = p_target[i]
        out.append(sample(residual, rng))
        return out
    out.append(sample(p_target[gamma], rng))
    return out


def _accept_one_hot(draft_tokens: np.ndarray, p_target: np.ndarray,
                    rng: np.random.Generator) -> list[int]:
    """`accept_drafts` for q one-hot at each draft token x. With q(x) = 1 the test r·q(x) <
    p(x) is r < p(x), and max(0, p - q) is p with p(x) set to 0 (p(x) <= 1), value for value:
    the same random draws pick the same tokens as the dense one-hot rows. A token past the
    target's vocabulary has p(x) = 0: always rejected, the residual p itself."""
    vocab = p_target.shape[-1]
    out: list[int] = []
    for i, x in enumerate(int(t) for t in draft_tokens):
        p_x = p_target[i, x] if x < vocab else 0.0
        if rng.random() < p_x:
            out.append(x)
            continue
        residual = p_target[i].copy()
        if x < vocab:
            residual[x] = 0.0
        if residual.sum() <= RESIDUAL_EPS:  # p was (up to rounding) one-hot at x itself
            residual = p_target[i]
        out.append(sample(residual, rng))
        return out
    out.append(sample(p_target[len(draft_tokens)], rng))
    return out


def accept_drafts_greedy(draft_tokens: np.ndarray, logits: np.ndarray) -> list[int]:
    """`accept_drafts` for temperature 0, on logits [γ+1, V] directly (after `penalize`, for
    parameters that read the context).

    Greedy p_target and p_draft are one-hot, so Algorithm 1 accepts a draft token exactly when it
    is the target's argmax, and the residual at the first mismatch is the target's one-hot: the
    same tokens as accept_drafts(draft_tokens, one-hot q, warp(logits), rng), without building V-wide
    rows or drawing random numbers.
    """
    _check_finite(logits)
    best = logits.argmax(axis=-1)
    gamma = len(draft_tokens)
    n_acc = int(np.argmin(np.r_[best[:gamma] == draft_tokens, False]))  # first mismatch
    return [int(t) for t in best[: n_acc + 1]]
