"""The GGUF fixture (tiny_models.write_gguf) loads through transformers the way
spec_export.sources.load does, with the weights de-quantized from exactly what was stored and the
tokenizer intact."""

import copy

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tiny_models import VOCAB, byte_tokenizer, llama, write_gguf


def load(path):
    name = path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True))
    return model.eval(), transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=name)


def round_tripped(model, qtype, embed_qtype):
    """A copy of `model` whose matrices went through quantize -> dequantize, as the file stores them."""
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # a tied lm_head is not listed again
            if p.ndim == 2:
                q = GGMLQuantizationType[embed_qtype if name == "model.embed_tokens.weight" else qtype]
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), q), q)).reshape(p.shape))
    return ref


@pytest.mark.parametrize("qtype,tied", [("Q4_1", True), ("Q4_0", False), ("Q8_0", True)])
def test_write_gguf_loads_in_transformers(tmp_path, qtype, tied):
    hf, tok = llama(3, tied=tied), byte_tokenizer()
    model, gguf_tok = load(write_gguf(hf, tok, tmp_path / f"tiny.{qtype}.gguf", qtype=qtype))

    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) \
        == (2, 64, 4, 2, VOCAB)
    assert c.tie_word_embeddings == tied

    ids = torch.tensor([[1, 74, 71, 78, 78, 81, 223, 89, 2, 0]])
    with torch.no_grad():
        got = model(ids).logits
        want = round_tripped(hf, qtype, "Q8_0")(ids).logits
        assert (got - hf(ids).logits).abs().max() > 1e-3  # the quantization is really there
    assert (got - want).abs().max() < 1e-4

    text = "hello world"
    assert gguf_tok(text).input_ids == tok(text).input_ids
    assert gguf_tok.decode(gguf_tok(text).input_ids) == text
    assert (gguf_tok.bos_token, gguf_tok.eos_token) == (tok.bos_token, tok.eos_token)
    assert gguf_tok.chat_template == tok.chat_template
