"""A trimmed draft head for speech (`specexport build --draft self --draft-vocab N` on Whisper):
the self draft's decoder scores only N ids (every special and timestamp id among them), its
q is zero elsewhere, and the output stays the target's: long-form greedy transcripts equal to
transformers' `generate` token for token, the sampled joint of the first two tokens with the
timestamp rules on by chi-square against exact enumeration, the graph's head held to PyTorch's
rows at the kept ids by `specexport verify`. A trimmed Whisper draft model too. The tiny
multilingual Whisper of test_longform.py (tiny_models.whisper(timestamps=True)): 283 ids, of
which 27 are special.
"""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the export extra is not installed")

import spec_runtime  # noqa: E402
from helpers import assert_input_error, run  # noqa: E402
from spec_export.build import build_bundle  # noqa: E402
from spec_runtime import longform  # noqa: E402
from test_longform import (HF_OPTIONS, exact_timestamp_joint, hf_segments,  # noqa: E402
                           sampled_pairs, saved_pair, speech_like)
from test_whisper import int8_head_rows  # noqa: E402

THREADS = 1
KEPT = 64  # of 283 ids: the 27 special ones and the first 37 bytes


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    root = tmp_path_factory.mktemp("whisper-vocab")
    t, d, tok = saved_pair(root)
    own = build_bundle(str(t), "self", root / "self", draft_vocab=KEPT, progress=False)
    other = build_bundle(str(t), str(d), root / "model", draft_vocab=KEPT, progress=False)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(t).eval()
    return {"dir": t, "self": own, "model": other, "hf": model,
            "specials": sorted(tok.added_tokens_decoder)}


def kept_ids(bundle) -> list[int]:
    return json.loads((bundle / "draft-vocab.json").read_text())["kept_ids"]


def test_the_self_drafts_head_keeps_n_ids_with_every_special_one(trimmed):
    bundle = trimmed["self"]
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["draft"]["vocab"]["size"] == KEPT == m["draft"]["vocab_size"]
    assert m["draft"]["vocab"]["embedding_rows"] == m["target"]["vocab_size"] == 283
    assert m["draft"]["shared_encoder"] is True and set(m["draft"]["graphs"]) == {"decoder"}
    assert int8_head_rows(bundle / "draft.decoder.onnx") == KEPT  # the step reads KEPT rows
    ids = kept_ids(bundle)
    assert len(ids) == KEPT and ids == sorted(set(ids))
    # every special id (timestamps, end of text, <|nospeech|> ...: the tokenizer's 27 added
    # tokens, 256..282), and bytes for the rest
    assert trimmed["specials"] == list(range(256, 283)) and set(trimmed["specials"]) <= set(ids)
    assert max(i for i in ids if i < 256) == KEPT - 27 - 1


@pytest.mark.parametrize("draft", ["self", "model"])
@pytest.mark.parametrize("case", sorted(HF_OPTIONS))
def test_greedy_long_form_with_a_trimmed_draft_is_transformers(trimmed, draft, case):
    gen = spec_runtime.load(trimmed[draft], threads=THREADS)
    hf_kw, form = HF_OPTIONS[case]
    accepted = 0
    for seed in range(2):
        x = speech_like(seed, 1.3)
        want = hf_segments(trimmed["hf"], x, "en", **hf_kw)
        got = longform.transcribe(gen, x, language="en", longform=form, gamma=3)
        assert [(s.tokens, s.start, s.end) for s in got.segments] == want
        accepted += got.stats.accepted
    assert accepted > 0, "no draft token was accepted: the draft went untested"


def test_sampled_pairs_with_timestamps_and_a_trimmed_draft_follow_the_target(trimmed):
    """The first two sampled tokens of a window, timestamp rules on (the first a timestamp, the
    second under the pair rule), against exact enumeration over transformers' logits and its
    own processors; the draft proposes only kept ids, and some of its tokens are accepted."""
    gen = spec_runtime.load(trimmed["self"], threads=THREADS)
    x = speech_like(0, 0.25)
    exact = exact_timestamp_joint(trimmed["hf"], x, [257, 258, 262])  # sot, en, transcribe
    outside = np.setdiff1d(np.arange(exact.shape[0]), kept_ids(trimmed["self"]))
    assert exact[:, outside].sum() > 0.05, "the target rarely leaves the kept ids: the " \
                                           "residual's share goes untested"
    p, accepted = sampled_pairs(gen, x, exact, gamma=3)
    print(f"p-value={p:.4f} accepted={accepted}")
    assert p > 1e-4 and accepted > 0


def test_specexport_verify_holds_the_trimmed_head_to_pytorch(trimmed):
    from spec_export.parity.verify import verify_bundle

    report = verify_bundle(trimmed["self"])
    assert report["graphs"]["draft/decoder"]["ok"] is True


def test_a_decoder_only_self_draft_cannot_be_trimmed(tmp_path):
    from draftproof.cli.specexport import main as specexport
    from tiny_models import llama, save

    t = save(llama(0), tmp_path / "t")
    out = tmp_path / "out"
    r = run(specexport, "build", "--target", t, "--out", out, "--max-len", 32, "--quiet",
            "--draft", "self", "--draft-vocab", "50")
    assert_input_error(r, "--draft-vocab 50", "own graph at a lower precision", "draft model")
    assert r.output.strip().count("\n") == 0 and not out.exists()


def test_a_whisper_draft_vocab_too_small_for_its_specials_is_refused(trimmed, tmp_path):
    from draftproof.cli.specexport import main as specexport

    out = tmp_path / "out"
    r = run(specexport, "build", "--target", trimmed["dir"], "--out", out, "--quiet",
            "--draft", "self", "--draft-vocab", "20")
    assert_input_error(r, "--draft-vocab 20 cannot hold", "at least 27")
    assert not out.exists()
