"""Small helpers shared by the CLI and bundle tests."""

import json

import numpy as np
from click.testing import CliRunner


def run(cli, *args, input=None):
    return CliRunner().invoke(cli, list(map(str, args)), input=input)


def assert_input_error(result, *words):
    """Bad input: exit code 2, the library's message, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for w in words:
        assert w in result.output, result.output


def edit_manifest(bundle, fn):
    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def assert_rows_alike(engine, seed: int = 1):
    """`engine` scores positions 20..29 bit for bit alike in 1-token steps, in two 5-token
    verify calls and in one prefill call: with 8-bit activations any last-bit difference
    upstream grows to ~0.5 in the logits, and greedy speculative output would part from
    greedy target-only output."""
    seq = np.random.default_rng(seed).integers(0, engine.vocab_size, 30)
    engine.forward(seq[:20], 0, 1)
    steps = np.stack([engine.forward(seq[k : k + 1], k, 1)[0].copy() for k in range(20, 30)])
    verify = np.concatenate([engine.forward(seq[20:25], 20, 5).copy(),
                             engine.forward(seq[25:30], 25, 5).copy()])
    prefill = engine.forward(seq, 0, 10).copy()
    np.testing.assert_array_equal(steps, verify)
    np.testing.assert_array_equal(steps, prefill)


# (position, tokens, logit rows) of the calls `call_schedule` makes: a prefill, a step, two
# 5-row verify calls where the second starts inside the first (a rollback: its slots are
# written again), a step after it; then a second request from position 0
CALLS = [(0, 17, 3), (17, 1, 1), (18, 5, 5), (20, 5, 5), (25, 1, 1)]


def call_schedule(engine, seed: int = 0):
    """The logit rows `engine` returns over CALLS, for one request and then a second one with
    other tokens (the same engine, as a server slot serves them): [rows, vocab]."""
    import numpy as np

    rows = []
    for request in range(2):
        seq = np.random.default_rng(seed + request).integers(3, 259, 40)
        engine.reset()
        for pos, n, k in CALLS:
            rows.append(np.array(engine.forward(seq[pos : pos + n], pos, k)))
    return np.concatenate(rows)
