"""Write a SmolLM2-135M-shaped Llama with random weights, and a byte-level tokenizer padded to
its vocabulary, as a save_pretrained directory: a target `specexport build --target DIR` takes
on a machine with neither the model hub nor a GGUF file. Its text means nothing; its shapes
(30 layers, hidden 576, 9 query and 3 KV heads of 64, FFN 1536, vocabulary 49152, tied
embeddings, RoPE θ 100000) make its calls cost what SmolLM2-135M's cost, which is what
scripts/gpu_check.sh --random-target measures, with exactness.

    python -m spec_export.random_target DIR [--seed 0]

`byte_tokenizer` is also the tokenizer of the tiny models the tests build.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's, at its ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2, initializer_range=0.02)


def byte_tokenizer(vocab_size: int):
    """Byte-level BPE without merges: the 3 specials, 256 bytes, then padding ids up to
    `vocab_size`, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for i in range(vocab_size - len(vocab)):
        vocab[f"<pad{i}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval()
    model.save_pretrained(args.out)
    byte_tokenizer(SMOLLM2_135M["vocab_size"]).save_pretrained(args.out)
    print(f"random SmolLM2-135M-shaped target in {args.out}")


if __name__ == "__main__":
    main()
