"""Small helpers shared by the CLI and bundle tests."""

import json

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
