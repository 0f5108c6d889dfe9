"""What parity runs on (spec_export/parity/quality.check_inputs): the parity texts as the tokenizer
encodes them, or, where it cannot represent them (a word-level vocabulary of its own: every word
`<unk>`, or no token at all), token ids drawn from its vocabulary, the same on every run, noted
in the manifest and the build's summary. Such a model builds, and its bundle decodes as Hugging
Face does."""

import json

import pytest
import torch
import tiny_models
from helpers import run
from tiny_models import VOCAB, byte_tokenizer, save, word_level_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import spec_runtime
from draftproof.cli.specexport import main as specexport
from spec_export.parity.quality import (PARITY_PROMPT, PARITY_TOKENS, QUANT_PROMPTS, QUANT_TOKENS,
                                 check_inputs)

WORDS = 320  # 4 specials and w0..w315
NEW_TOKENS = 12


def test_a_tokenizer_that_reads_the_texts_gives_their_own_ids():
    tok = byte_tokenizer()
    parity, quant, note = check_inputs(tok, VOCAB)
    assert parity == tok(PARITY_PROMPT)["input_ids"][:PARITY_TOKENS]
    assert quant == [tok(t)["input_ids"][:QUANT_TOKENS] for t in QUANT_PROMPTS]
    assert note is None


def test_unknown_words_give_ordinary_ids_from_the_vocabulary_the_same_every_time():
    tok = word_level_tokenizer()
    assert set(tok(PARITY_PROMPT)["input_ids"]) == {tok.unk_token_id}  # what the texts become
    parity, quant, note = check_inputs(tok, WORDS)
    special = set(tok.all_special_ids)
    drawn = {i for ids in quant for i in ids}
    assert drawn and not drawn & special and max(drawn) < WORDS
    assert len(drawn) > WORDS // 4  # spread over the vocabulary, not one id
    assert parity == quant[0][:PARITY_TOKENS] and len(quant) == len(QUANT_PROMPTS)
    assert (parity, quant) == check_inputs(tok, WORDS)[:2]
    assert "<unk> and special tokens only" in note and "drawn from its vocabulary" in note


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_model_with_a_word_level_vocabulary_builds_and_decodes_as_hf(family, tmp_path):
    model = getattr(tiny_models, family)(0, vocab=WORDS)
    src = save(model, tmp_path / "model", word_level_tokenizer())
    r = run(specexport, "build", "--target", src, "--draft", "ngram", "--max-len", 64, "--out",
            tmp_path / "b")
    assert r.exit_code == 0, r.output
    assert "drawn from its vocabulary" in r.output and "prompt_ids is empty" not in r.output
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert "drawn from its vocabulary" in m["target"]["parity"]["inputs"]
    # what transformers' tokenizer for this family makes of text: the note says which
    encoded = AutoTokenizer.from_pretrained(src)(PARITY_PROMPT)["input_ids"]
    assert ("no token at all" in m["target"]["parity"]["inputs"]) == (encoded == [])

    ids = check_inputs(word_level_tokenizer(), WORDS)[0][:10]
    hf = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    gen = spec_runtime.load(tmp_path / "b")
    gen.eos_token_ids = frozenset()
    assert gen.generate(ids, max_new_tokens=NEW_TOKENS, chat=False).tokens == want


def test_verify_measures_on_the_same_ids(tmp_path):
    src = save(tiny_models.qwen2(0, vocab=WORDS), tmp_path / "model", word_level_tokenizer())
    assert run(specexport, "build", "--target", src, "--draft", "ngram", "--max-len", 64,
               "--out", tmp_path / "b", "--quiet").exit_code == 0
    r = run(specexport, "verify", "-b", tmp_path / "b")
    assert r.exit_code == 0, r.output
    assert "1 of 1 checks passed" in r.output
