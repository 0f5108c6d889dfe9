"""A bundle built with --max-batch decodes requests together through its lanes graph, and every
result is the one the request gets alone, token for token (greedy and seeded samples, fp32 and
int4, with and without the draft, requests of different lengths joining mid-way). The
load-time check is what guarantees it on the machine the tests run on: where it finds the
lanes' rows differ from single calls, batching is off and the same equalities hold one request
at a time (the tests print which)."""

import json
from dataclasses import replace

import numpy as np
import pytest
from conftest import build_llama_pair

import spec_runtime
from spec_runtime import GenerationOptions
from spec_runtime.engines import lanes as lanes_module

PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "ab" * 9, "zz top",
           "one two three four five six seven", "q"]


@pytest.fixture(scope="module", params=["fp32", "int4"])
def batch_bundle(request, tmp_path_factory):
    extra = {} if request.param == "fp32" else {"precision": "int4"}
    return build_llama_pair(tmp_path_factory.mktemp(f"batch_{request.param}"), max_batch=4,
                            **extra)[2]


def test_the_bundle_batches_and_each_result_is_the_requests_alone(batch_bundle):
    gen = spec_runtime.load(batch_bundle)
    lanes, check, _ = gen.lanes
    print(f"lanes {lanes.lanes}; check: {check}")
    options = [GenerationOptions(max_new_tokens=24, chat=False),
               GenerationOptions(max_new_tokens=31, temperature=0.9, seed=4, chat=False),
               GenerationOptions(max_new_tokens=12, gamma=1, chat=False),
               GenerationOptions(max_new_tokens=20, use_draft=False, chat=False),
               GenerationOptions(max_new_tokens=27, temperature=1.1, top_k=20, seed=9,
                                 chat=False),
               GenerationOptions(max_new_tokens=8, chat=False),
               GenerationOptions(max_new_tokens=16, logprobs=2, chat=False)]
    requests = [gen.request(p, o) for p, o in zip(PROMPTS, options)]
    alone = [gen.generate(r) for r in requests]
    calls = []
    forward = lanes.forward
    lanes.forward = lambda c: calls.append(len(c)) or forward(c)
    try:
        together = gen.generate_batch(requests)
    finally:
        del lanes.forward
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens and b.text == a.text
        assert b.finish_reason == a.finish_reason
    assert [t.logprob for t in together[-1].logprobs] == [t.logprob for t in alone[-1].logprobs]
    if check.identical:
        assert gen.max_batch == 4 and max(calls) == 4, calls
    else:
        assert gen.max_batch == 1 and not calls


def test_a_lane_that_scores_otherwise_turns_batching_off(batch_bundle, monkeypatch):
    """The load-time check is not a formality: lanes whose rows are off by one bit in one
    lane are found, and the generator decodes one request at a time."""
    forward = lanes_module.LaneEngine.forward

    def off_by_a_bit(self, calls):
        rows = forward(self, calls)
        rows[-1][...] = np.nextafter(rows[-1], np.inf)
        return rows

    monkeypatch.setattr(lanes_module.LaneEngine, "forward", off_by_a_bit)
    gen = spec_runtime.load(batch_bundle)
    assert not gen.lanes[1].identical and gen.lanes[1].largest_diff > 0
    assert gen.max_batch == 1


def test_a_bundle_without_lanes_decodes_a_batch_one_request_at_a_time(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    assert gen.lanes is None and gen.max_batch == 1
    options = GenerationOptions(max_new_tokens=10, chat=False)
    assert [r.tokens for r in gen.generate_batch(PROMPTS[:3], options)] == \
        [gen.generate(p, options).tokens for p in PROMPTS[:3]]


# -- specrun generate --prompts ------------------------------------------------------------


def test_generate_prompts_file_gives_each_line_its_own_result(batch_bundle, tmp_path):
    """Plain lines and JSON lines with options of their own; each result is `generate` of that
    line's prompt and options alone, printed with its line number as it ends."""
    from draftproof.cli.specrun import main as specrun
    from helpers import run

    lines = ["hello world", "", json.dumps({"prompt": "zz top", "max_new_tokens": 5,
                                            "temperature": 0.8, "seed": 2}),
             "the quick brown fox", json.dumps({"prompt": "a", "use_draft": False})]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    r = run(specrun, "generate", "--prompts", path, "-b", batch_bundle, "--max-new-tokens", 9,
            "--no-chat")
    assert r.exit_code == 0, r.output
    got = {o["line"]: o for o in map(json.loads, r.stdout.splitlines())}
    assert sorted(got) == [1, 3, 4, 5]
    gen = spec_runtime.load(batch_bundle)
    base = GenerationOptions(max_new_tokens=9, chat=False)
    want = {1: gen.generate("hello world", base),
            3: gen.generate("zz top", replace(base, max_new_tokens=5, temperature=0.8, seed=2)),
            4: gen.generate("the quick brown fox", base),
            5: gen.generate("a", replace(base, use_draft=False))}
    for number, result in want.items():
        assert got[number]["tokens"] == result.tokens and got[number]["text"] == result.text
        assert got[number]["finish_reason"] == result.finish_reason


@pytest.mark.parametrize("content, words", [
    ('hello\n{"prompt": "a", "temperature": -1}\n', ["line 2", "temperature=-1 is invalid"]),
    ('{"prompt": "a", "tempurature": 1}\n', ["line 1", "'tempurature'", "temperature"]),
    ('hi\n{"prompt": "a"\n', ["line 2", "is not a JSON object"]),
    ('{"max_new_tokens": 3}\n', ["line 1", "no \"prompt\""]),
    ("\n\n", ["holds no prompt"]),
    ("ok\n" + "word " * 400 + "\n", ["line 2", "cache positions"]),
])
def test_a_bad_line_of_a_prompts_file_is_named_before_anything_is_decoded(
        llama_pair, tmp_path, content, words):
    from draftproof.cli.specrun import main as specrun
    from helpers import assert_input_error, run

    path = tmp_path / "prompts.txt"
    path.write_text(content)
    r = run(specrun, "generate", "--prompts", path, "-b", llama_pair[2], "--max-new-tokens", 64,
            "--no-chat")
    assert_input_error(r, f"--prompts {str(path)!r}", *words)
    assert r.stdout == ""


def test_prompts_file_and_a_prompt_are_not_both_taken(llama_pair, tmp_path):
    from draftproof.cli.specrun import main as specrun
    from helpers import assert_input_error, run

    path = tmp_path / "prompts.txt"
    path.write_text("hi\n")
    r = run(specrun, "generate", "hello", "--prompts", path, "-b", llama_pair[2])
    assert_input_error(r, "--prompts reads every prompt from its file")


def test_a_slots_memory_counts_each_cache_once_in_a_lanes_bundle(batch_bundle):
    """The lanes graph's cache inputs are the slots' own caches bound lane by lane: a slot holds
    the decoder graphs' caches, counted by hand here from their shapes (float32)."""
    from spec_runtime.bundle.manifest import read_manifest
    from spec_runtime.engines.devices import DEVICES
    from spec_runtime.limits import slot_bytes

    manifest = read_manifest(batch_bundle, check_files=False)
    by_hand = sum(int(np.prod(io["shape"])) * 4 for _, model in manifest.models()
                  for io in model.graphs["decoder"].inputs if io["name"].startswith("past_"))
    cpu = DEVICES["cpu"]
    assert slot_bytes(manifest, {"target": cpu, "draft": cpu}) == by_hand


def test_bench_concurrency_measures_both_modes_in_flight_together(batch_bundle, tmp_path):
    """specrun bench --concurrency 3: each γ's speculative and target-only totals, greedy
    outputs equal between the modes (the oracle: target-only decoding of the same prompts)."""
    from draftproof.cli.specrun import main as specrun
    from helpers import run

    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:4]) + "\n")
    r = run(specrun, "bench", "-b", batch_bundle, "--prompts", path, "--concurrency", 3,
            "--max-new-tokens", 10, "--gamma", "2,4", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["concurrency"] == 3 and report["requests"] == 4
    assert [row["gamma"] for row in report["rows"]] == [2, 4]
    gen = spec_runtime.load(batch_bundle)
    alone = sum(len(gen.generate(p, max_new_tokens=10, use_draft=False).tokens)
                for p in PROMPTS[:4])
    for row in report["rows"]:
        assert row["identical"] is True
        for mode in ("speculative", "target_only"):
            m = row[mode]
            assert m["new_tokens"] == alone and m["tokens_per_s"] > 0
            assert 0 < m["ms_per_token_p50"] <= m["ms_per_token_p95"]
    r = run(specrun, "bench", "-b", batch_bundle, "--concurrency", 0)
    assert r.exit_code == 2 and "--concurrency" in r.output
