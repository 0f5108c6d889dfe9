"""The target's 1-row calls: the load-time check (spec_runtime/engines/rows.py) and the padded form.

Stand-in engines play the kernels of the machines the runtime meets: one that scores every call
shape alike (AVX-512's MatMulNBits), one whose 1-row calls take another kernel (AVX2's), one
whose rows depend on the call's length (dynamic activation quantization). The oracle for a
position's logits is the toy model itself, evaluated on the tokens of the cache."""

import logging

import numpy as np
import pytest
from toy_models import ToyEngine

from spec_runtime import Generator, ModelDraft, NgramDraft
from spec_runtime.engines.protocol import ChunkedEngine
from spec_runtime.engines.rows import choose_one_row, probe


class KernelEngine(ChunkedEngine):
    """A ToyEngine's model behind ChunkedEngine, whose numbers depend on the call's shape as
    the named kernels make them: `one_row` adds a position-dependent offset to every 1-row
    call's logits (another kernel: an error that flips near-tied argmaxes), `per_row` an offset
    proportional to the call's length (a scale shared by the call's rows)."""

    def __init__(self, vocab=6, max_len=64, seed=0, one_row=0.0, per_row=0.0, prefill_chunk=16):
        self.seed = seed
        self.model = ToyEngine(vocab=vocab, max_len=max_len, seed=seed)
        self.vocab_size, self.max_len, self.prefill_chunk = vocab, max_len, prefill_chunk
        self.one_row_error, self.per_row_error = one_row, per_row
        self.offsets = np.random.default_rng(seed + 100).normal(size=(max_len, vocab))
        self.calls = []  # (rows, position) of every graph call

    def reset(self):
        pass

    def _run(self, tokens, pos, num_logits):
        n = len(tokens)
        self.calls.append((n, pos))
        logits = self.model.forward(tokens, pos, n)  # writes the "cache" like a graph
        t = np.arange(pos, pos + n)
        if n == 1:
            logits = logits + self.one_row_error * self.offsets[t]
        logits = logits + self.per_row_error * n
        return logits[-num_logits:].astype(np.float32)

    def fork(self):  # the same model (its seed), a cache of its own
        return self._same_form(KernelEngine(self.vocab_size, self.max_len, self.seed,
                                            self.one_row_error, self.per_row_error,
                                            self.prefill_chunk))


def truth(engine, seq, p):
    """The model's logits at position p of seq, from its tables alone."""
    m = engine.model
    prev = seq[p - 1] if p > 0 else 0
    return (m.a[seq[p]] + m.b[prev] + m.c[p % 3]).astype(np.float32)


def test_the_check_keeps_steps_as_they_are_where_every_shape_agrees():
    engine = KernelEngine()
    check = probe(engine)
    assert (check.one_row, check.identical) == ("as-is", True)
    assert check.as_is_diff == check.multi_row_diff == 0.0 and check.padded_diff is None
    engine.calls.clear()
    engine.forward(np.array([1]), 5, 1)
    assert engine.calls == [(1, 5)]  # no second row


def test_the_check_pads_steps_where_a_1_row_call_takes_another_kernel():
    engine = KernelEngine(one_row=0.5)
    check = probe(engine)
    assert (check.one_row, check.identical, check.chosen_by) == ("padded", True, "probe")
    assert check.as_is_diff > 0.1 and check.padded_diff == 0.0
    assert "padded to 2 rows" in check.describe()
    # a padded step is the 2-row call [previous token, token] one position back
    seq = np.array([3, 1, 4, 1, 5])
    engine.forward(seq[:4], 0, 1)
    engine.calls.clear()
    row = engine.forward(seq[4:5], 4, 1)
    assert engine.calls == [(2, 3)]
    np.testing.assert_array_equal(row[0], truth(engine, seq, 4))


def test_a_padded_step_at_the_first_and_the_last_slot():
    engine = KernelEngine(one_row=0.5, max_len=16)
    engine.set_one_row("padded")
    row = engine.forward(np.array([2]), 0, 1)  # nothing before it: [token, token] at 0
    assert engine.calls[-1] == (2, 0)
    np.testing.assert_array_equal(row[0], truth(engine, np.array([2]), 0))
    seq = np.random.default_rng(0).integers(0, 6, 16)
    engine.forward(seq[:15], 0, 1)
    row = engine.forward(seq[15:], 15, 1)  # slot max_len - 1: stays inside the cache
    assert engine.calls[-1] == (2, 14)
    np.testing.assert_array_equal(row[0], truth(engine, seq, 15))


def test_a_padded_step_after_a_rollback_reads_the_accepted_token():
    """Slot pos - 1 is whatever the last call wrote there: after a verify call whose later
    drafts were rejected, a step at the first rejected slot pads with the accepted token."""
    engine = KernelEngine(one_row=0.5)
    engine.set_one_row("padded")
    engine.forward(np.array([1, 2, 3, 4]), 0, 1)
    engine.forward(np.array([5, 0, 0, 0]), 4, 4)  # drafts 0 0 0 after 5; only the first kept
    row = engine.forward(np.array([3]), 6, 1)  # correction at slot 6, after 1 2 3 4 5 0
    seq = np.array([1, 2, 3, 4, 5, 0, 3])
    np.testing.assert_array_equal(row[0], truth(engine, seq, 6))


def test_a_1_token_prefill_chunk_is_padded_too():
    engine = KernelEngine(one_row=0.5, prefill_chunk=4)
    engine.set_one_row("padded")
    engine.forward(np.arange(5) % 6, 0, 1)  # chunks of 4: [0..0] is a 1-token chunk
    assert all(rows > 1 for rows, _ in engine.calls), engine.calls


def test_rows_that_depend_on_the_call_length_are_reported_not_hidden(caplog):
    engine = KernelEngine(per_row=1e-3)
    with caplog.at_level(logging.WARNING, logger="spec_runtime.engines.rows"):
        check = probe(engine)
    assert check.identical is False and check.multi_row_diff > 0
    assert check.one_row in ("as-is", "padded")
    assert "NOT bit-identical" in check.describe() and "NOT bit-identical" in caplog.text


def test_a_given_form_is_taken_unmeasured_and_a_bad_one_refused():
    engine = KernelEngine(one_row=0.5)
    check = choose_one_row(engine, "padded")
    assert (check.chosen_by, check.identical, engine.one_row) == ("given", None, "padded")
    assert choose_one_row(ToyEngine(), "auto") is None  # an engine without forms
    from spec_runtime.errors import FieldError

    for bad in ("sideways", "AS-IS", None, 1):
        with pytest.raises(FieldError, match=f"one_row={bad!r} is invalid") as e:
            choose_one_row(engine, bad)
        assert e.value.field == "one_row"
    assert engine.one_row == "padded" and str(engine.one_row) == "padded"  # unchanged
    import spec_runtime

    with pytest.raises(FieldError, match="one_row='sideways'"):  # before the bundle is read
        spec_runtime.load(ENGINE_LESS, one_row="sideways")


ENGINE_LESS = "/nonexistent/bundle"  # no such bundle: the value is refused first


def test_forks_keep_the_form():
    engine = KernelEngine(one_row=0.5)
    probe(engine)
    assert engine.fork().one_row == "padded"


def _greedy_pair(engine, draft):
    gen = Generator(engine, draft, max_gamma=4)
    out = []
    for prompt in ([1, 2, 3], [4, 4, 4, 4, 4], [0, 5, 2, 5, 2, 5, 2]):
        spec = gen.generate(prompt, max_new_tokens=30, gamma=3)
        base = gen.generate(prompt, max_new_tokens=30, use_draft=False)
        out.append((spec.tokens, base.tokens, spec.stats))
    return out


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_greedy_speculative_equals_target_only_in_the_form_the_check_chose(draft):
    """With the offset kernel, steps left as they are leave the greedy path of the verify
    calls (the power check); in the form the check chose they do not."""
    def make():
        engine = KernelEngine(one_row=0.5)
        d = ModelDraft(ToyEngine(seed=1, like=engine.model, mix=0.3)) if draft == "model" \
            else NgramDraft(6)
        return engine, d

    engine, d = make()
    engine.set_one_row("as-is")
    assert any(s != b for s, b, _ in _greedy_pair(engine, d))
    engine, d = make()
    probe(engine)
    for spec, base, stats in _greedy_pair(engine, d):
        assert spec == base
        assert stats.target_one_row == "padded"
