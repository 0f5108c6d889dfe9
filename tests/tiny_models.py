"""Tiny random Hugging Face models saved with save_pretrained, with a real byte-level tokenizer,
so that export, bundle and CLI tests run the same code paths as for a downloaded checkpoint."""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)

from spec_export.random_target import SPECIALS
from spec_export.random_target import byte_tokenizer as _byte_tokenizer


def byte_tokenizer(extra: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: 3 specials + 256 bytes (+ `extra` padding ids)."""
    return _byte_tokenizer(len(SPECIALS) + 256 + extra)


VOCAB = len(SPECIALS) + 256


def llama(seed: int, hidden=64, layers=2, heads=4, kv_heads=2, tied=True, vocab=VOCAB, **kw):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.2, **kw)
    return LlamaForCausalLM(cfg)


def gpt2(seed: int, hidden=64, layers=2, heads=4, vocab=VOCAB):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                     n_positions=512, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    return GPT2LMHeadModel(cfg)


def save(model, directory: Path, tokenizer=None) -> Path:
    model.save_pretrained(directory)
    (tokenizer or byte_tokenizer()).save_pretrained(directory)
    return directory


def write_gguf(model, tokenizer, path, qtype="Q4_1", embed_qtype="Q8_0") -> Path:
    """Write a tiny LlamaForCausalLM and its byte-level BPE tokenizer as a GGUF file laid out the way
    llama.cpp's convert_hf_to_gguf.py (then llama-quantize) writes a llama model with a "gpt2"
    tokenizer, so that GGUF loading can be tested without downloading one.

    2-D weights are stored in `qtype` (Q4_0, Q4_1 or Q8_0), the token embedding in `embed_qtype`
    (real Q4_1 files keep it in Q8_0), norms in F32; q/k rows carry llama.cpp's RoPE permutation,
    which transformers undoes on load."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    path, cfg = Path(path), model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # tokenizer, as convert_hf_to_gguf's get_vocab_base() + SpecialVocab write it
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.UNUSED if i not in by_id else gguf.TokenType.NORMAL if i not in added
                     else gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    else:  # gguf-py cannot write an empty array, and without merges transformers derives them from scores
        w.add_token_scores([0.0] * len(tokens))
    for kind in ("bos", "eos", "unk", "pad"):
        if (token_id := getattr(tokenizer, f"{kind}_token_id")) is not None:
            getattr(w, f"add_{kind}_token_id")(token_id)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base) + "." + suffix
        t = t.detach().float().numpy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):  # convert_hf_to_gguf's LlamaModel.permute
            n = heads if "attn_q" in name else kv_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        if t.ndim == 1:
            w.add_tensor(name, t)
        else:
            q = Q[embed_qtype if name == "token_embd.weight" else qtype]
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def word_tokenizer(n: int) -> PreTrainedTokenizerFast:
    """A whitespace word tokenizer over n words w0..w{n-1} (w0 doubles as unk and EOS), for
    models whose vocabulary is small enough to enumerate every 3-token continuation."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w0")


def truncated(model, layers: int):
    """The first `layers` blocks of `model` with its embeddings and head: a smaller draft that
    agrees with the target often enough for acceptances to be exercised."""
    cfg = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": layers})
    small = model.__class__(cfg)
    state = {k: v for k, v in model.state_dict().items()
             if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers}
    small.load_state_dict(state, strict=True)
    return small


# -- T5 (encoder-decoder) ----------------------------------------------------------------------

T5_SPECIALS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2 as in T5's SentencePiece vocabulary


def t5_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges, T5-style: <pad>=0 (also the decoder start), </s>=1 appended
    to every encoded text, <unk>=2, then 256 bytes: 259 ids, like byte_tokenizer()."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(T5_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(T5_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>")


def t5(seed: int, d_model=64, layers=2, heads=4, d_kv=16, gated=False, vocab=VOCAB):
    """gated=False: the v1.0 layout (ReLU FFN, tied lm_head, output rescale); gated=True: the
    v1.1 / flan layout (gated-GELU FFN, own lm_head, no rescale)."""
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=2 * d_model, num_layers=layers,
                   num_heads=heads, feed_forward_proj="gated-gelu" if gated else "relu",
                   tie_word_embeddings=not gated, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1, relative_attention_num_buckets=8,
                   relative_attention_max_distance=32)  # small: positions reach the log buckets
    model = T5ForConditionalGeneration(cfg)
    if gated:
        _untie_lm_head(model, torch.randn(vocab, d_model) * d_model**-0.5)
    return model


def _untie_lm_head(model, weight):
    # transformers 5 ties lm_head to the embedding at init whatever the layout; a flan-t5
    # checkpoint stores its own, which from_pretrained keeps (it unties differing tensors)
    model.lm_head.weight = torch.nn.Parameter(weight.clone())


def truncated_t5(model, layers: int):
    """The first `layers` blocks of both stacks of a T5, with its embeddings, relative biases
    (block 0) and head."""
    cfg = T5Config.from_dict({**model.config.to_dict(), "num_layers": layers,
                              "num_decoder_layers": layers})
    small = T5ForConditionalGeneration(cfg)
    if model.lm_head.weight is not model.shared.weight:
        _untie_lm_head(small, model.lm_head.weight.detach())
    state = {k: v for k, v in model.state_dict().items()
             if ".block." not in k or int(k.split(".block.")[1].split(".")[0]) < layers}
    small.load_state_dict(state, strict=True)
    return small
