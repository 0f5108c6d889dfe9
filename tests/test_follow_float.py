"""How far a quantized graph's greedy output follows the float model's: the build counts, per
check prompt, the tokens before the two first differ (one teacher-forced call a prompt), records
them in the manifest and prints them in its summary. Oracle: transformers' greedy `generate` of
the float model against the graph decoded one token a call."""

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def int8_build(tmp_path_factory):
    from conftest import build_llama_pair

    # int8: a tiny random model's int4 graph leaves the float model at the first token, which
    # would not tell a count from an off-by-one row
    return build_llama_pair(tmp_path_factory.mktemp("int8"), precision="int8")


def step_by_step_counts(model_dir, graph) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_export.parity.calls import open_decoder
    from spec_export.parity.quality import FOLLOW_TOKENS, check_inputs

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    _, prompts, _ = check_inputs(AutoTokenizer.from_pretrained(model_dir), hf.config.vocab_size)
    # 1-token calls padded to the multi-row kernels the build's one call ran on: on a machine
    # whose 1-row kernels round otherwise a near tie could flip (rows.py)
    engine = open_decoder(graph, one_row="padded")
    counts = []
    for ids in prompts:
        with torch.no_grad():  # past an end-of-text token, without the model's own defaults
            out = hf.generate(torch.tensor([ids]), max_new_tokens=FOLLOW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0, repetition_penalty=1.0)
        counts.append(agreed(out[0, len(ids):].tolist(), greedy_steps(engine, ids)))
    return counts


def greedy_steps(engine, prompt: list[int]) -> list[int]:
    """The graph's greedy decoding of `prompt`, FOLLOW_TOKENS tokens, one token a call."""
    from spec_export.parity.quality import FOLLOW_TOKENS

    ours, row = [], engine.forward(np.asarray(prompt, np.int64), 0, 1)
    while len(ours) < FOLLOW_TOKENS:
        ours.append(int(row[-1].argmax()))
        row = engine.forward(np.asarray(ours[-1:], np.int64), len(prompt) + len(ours) - 1, 1)
    return ours


def agreed(float_tokens: list[int], ours: list[int]) -> int:
    """How many tokens the two agree on before they first differ."""
    same = [a == b for a, b in zip(float_tokens, ours)] + [False]
    return same.index(False)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_recorded_counts_are_those_of_step_by_step_greedy_runs(int8_build, role):
    from spec_export.parity.quality import FOLLOW_TOKENS
    from spec_export.bundle.summary import _parity
    from spec_runtime.bundle.manifest import read_manifest

    target_dir, draft_dir, bundle = int8_build
    manifest = read_manifest(bundle)
    entry = manifest.target if role == "target" else manifest.draft.model
    measured = entry.parity["int8"]
    want = step_by_step_counts(target_dir if role == "target" else draft_dir,
                               bundle / entry.graphs["decoder"].file)
    assert measured["follows_float"] == want
    assert measured["follow_tokens"] == [FOLLOW_TOKENS] * len(want)
    line = _parity(role, entry, False)
    assert "greedy output follows the float model's for " + \
        ", ".join(f"{n}/{FOLLOW_TOKENS}" for n in want) + " tokens" in line


def test_the_counts_tell_apart_what_they_measure(int8_build):
    """Not all 0 nor all FOLLOW_TOKENS on this pair, so an off-by-one row or a count that
    stops at the continuation's length would fail the test above."""
    from spec_export.parity.quality import FOLLOW_TOKENS
    from spec_runtime.bundle.manifest import read_manifest

    manifest = read_manifest(int8_build[2])
    counts = manifest.target.parity["int8"]["follows_float"] + \
        manifest.draft.model.parity["int8"]["follows_float"]
    assert any(0 < n < FOLLOW_TOKENS for n in counts), counts


# -- an encoder-decoder (Whisper) ------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_builds(tmp_path_factory):
    """A tiny Whisper built at int8, and at float32 with its int8 self draft (whose decoder
    is checked over its float encoder: the target's)."""
    from spec_export.build import build_bundle
    from tiny_models import save, whisper, whisper_tokenizer

    root = tmp_path_factory.mktemp("whisper-int8")
    model = whisper(6, d_model=64)
    with torch.no_grad():  # specials no louder than text: the greedy path is not one special
        model.model.decoder.embed_tokens.weight[256:] /= 8  # repeated, and int8 leaves it
    model_dir = save(model, root / "model", whisper_tokenizer())
    return model_dir, {
        "target": build_bundle(str(model_dir), "ngram", root / "int8", precision="int8",
                               progress=False),
        "draft": build_bundle(str(model_dir), "self", root / "self", progress=False)}


def step_by_step_seq2seq(model_dir, bundle, role) -> list[int]:
    """The counts by another road: the float model decoding with its own cache, one token a
    forward, and the graphs one token a call."""
    from transformers import AutoTokenizer, WhisperForConditionalGeneration

    from spec_export.bundle.build_seq2seq import parity_inputs
    from spec_export.parity.calls import open_decoder
    from spec_export.parity.quality import FOLLOW_TOKENS, check_inputs
    from spec_runtime.bundle.manifest import read_manifest

    hf = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    ids, _, _ = check_inputs(AutoTokenizer.from_pretrained(model_dir), hf.config.vocab_size)
    manifest = read_manifest(bundle)
    source, prompt = parity_inputs(hf, ids, manifest.max_source_len)
    entry = manifest.target if role == "target" else manifest.draft.model
    # 1-token calls padded to the multi-row kernels the build's one call ran on (rows.py)
    engine = open_decoder(bundle / entry.graphs["decoder"].file, 1, 0, one_row="padded",
                          encoder_path=bundle / manifest.target.graphs["encoder"].file)
    engine.encode_source(source)
    features = torch.tensor(source)[None]
    counts = []
    for start in (prompt[:1], prompt):
        with torch.no_grad():
            out = hf(input_features=features, decoder_input_ids=torch.tensor([start]),
                     use_cache=True)
            float_tokens = []
            while len(float_tokens) < FOLLOW_TOKENS:
                float_tokens.append(int(out.logits[0, -1].argmax()))
                cache = getattr(out, "cache", None)  # renamed in transformers 5
                past = {"cache": cache} if cache is not None else \
                    {"past_key_values": out.past_key_values}
                out = hf(encoder_outputs=(out.encoder_last_hidden_state,), **past,
                         decoder_input_ids=torch.tensor([float_tokens[-1:]]), use_cache=True)
        engine.reset()
        counts.append(agreed(float_tokens, greedy_steps(engine, start)))
    return counts


@pytest.mark.parametrize("role", ["target", "draft"])
def test_an_int8_whispers_counts_are_those_of_step_by_step_greedy_runs(whisper_builds, role):
    from spec_export.parity.quality import FOLLOW_TOKENS
    from spec_export.bundle.summary import _parity
    from spec_runtime.bundle.manifest import read_manifest

    model_dir, bundles = whisper_builds
    manifest = read_manifest(bundles[role])
    entry = manifest.target if role == "target" else manifest.draft.model
    assert entry.precision == "int8"
    measured = entry.parity["int8"]
    want = step_by_step_seq2seq(model_dir, bundles[role], role)
    assert measured["follows_float"] == want
    assert measured["follow_tokens"] == [FOLLOW_TOKENS] * 2
    assert "greedy output follows the float model's for " + \
        ", ".join(f"{n}/{FOLLOW_TOKENS}" for n in want) + " tokens" in _parity(role, entry, True)


def test_an_int8_whispers_counts_tell_apart_what_they_measure(whisper_builds):
    from spec_export.parity.quality import FOLLOW_TOKENS
    from spec_runtime.bundle.manifest import read_manifest

    target, draft = (read_manifest(whisper_builds[1][r]) for r in ("target", "draft"))
    counts = target.target.parity["int8"]["follows_float"] + \
        draft.draft.model.parity["int8"]["follows_float"]
    assert any(0 < n < FOLLOW_TOKENS for n in counts), counts
