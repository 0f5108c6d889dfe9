"""Tiny random Hugging Face models saved with save_pretrained, with a real byte-level tokenizer,
so that export, bundle and CLI tests run the same code paths as for a downloaded checkpoint."""

import json
from pathlib import Path

import numpy as np
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


# -- the other Llama-based families: 3 layers, head_dim 16 (the fused kernels' multiple), a
# sliding window of 8 where the family has one, so that tests cross it within a few tokens

WINDOW = 8


def _family(config_cls, model_cls, seed, hidden=64, layers=3, heads=4, kv_heads=2, vocab=VOCAB,
            **kw):
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, max_position_embeddings=512, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0, initializer_range=0.2, **kw)
    model = model_cls(cfg)
    _jitter_norms(model)
    return model


def _jitter_norms(model):
    """RMSNorm weights away from their initial ones (or zeros): a norm applied to the wrong
    tensor, or a (1 + w) read as w, then changes the logits."""
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name:
                t.add_(torch.randn_like(t) * 0.3)


def qwen2(seed: int, tied=False, window=WINDOW, **kw):
    """Qwen2: q/k/v biases (jittered: HF initialises them to 0); layers from max_window_layers
    (1) on slide over `window` keys."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = _family(Qwen2Config, Qwen2ForCausalLM, seed, tie_word_embeddings=tied,
                    use_sliding_window=window is not None, sliding_window=window,
                    max_window_layers=1, **kw)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("proj.bias"):
                t.add_(torch.randn_like(t) * 0.3)
    return model


def qwen3(seed: int, tied=True, **kw):
    """Qwen3: q/k norms, head_dim 32 where hidden / heads is 16, biases on all projections."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _family(Qwen3Config, Qwen3ForCausalLM, seed, head_dim=32, attention_bias=True,
                   tie_word_embeddings=tied, **kw)


def mistral(seed: int, window=WINDOW, **kw):
    """Mistral: every layer slides over `window` keys."""
    from transformers import MistralConfig, MistralForCausalLM

    return _family(MistralConfig, MistralForCausalLM, seed, sliding_window=window, **kw)


def gemma3(seed: int, window=WINDOW, layers=3, **kw):
    """Gemma 3 text: one KV head (as in 270M), layers sliding, global, sliding..., each kind with
    its own RoPE base, the global one linearly scaled; query_pre_attn_scalar differs from
    head_dim so that the two scales cannot be confused."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    return _family(Gemma3TextConfig, Gemma3ForCausalLM, seed, layers=layers, kv_heads=1,
                   head_dim=16, query_pre_attn_scalar=24, sliding_window=window,
                   layer_types=types, rope_parameters=rope, **kw)


def gpt2(seed: int, hidden=64, layers=2, heads=4, vocab=VOCAB):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                     n_positions=512, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    return GPT2LMHeadModel(cfg)


def save(model, directory: Path, tokenizer=None) -> Path:
    model.save_pretrained(directory)
    (tokenizer or byte_tokenizer()).save_pretrained(directory)
    return directory


def write_gguf(model, tokenizer, path, qtype="Q4_1", embed_qtype="Q8_0", qtypes=None) -> Path:
    """Write a tiny LlamaForCausalLM and its byte-level BPE tokenizer as a GGUF file laid out the way
    llama.cpp's convert_hf_to_gguf.py (then llama-quantize) writes a llama model with a "gpt2"
    tokenizer, so that GGUF loading can be tested without downloading one.

    2-D weights are stored in `qtype`, the token embedding in `embed_qtype` (real Q4_1 files keep
    it in Q8_0), and the tensors named in `qtypes` ({"blk.0.attn_v.weight": "Q6_K", ...}) in
    theirs; norms in F32. Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 quantize the model's weights with
    gguf-py; K-quants, which gguf-py cannot quantize, are random_kquant blocks (the weights the
    file then holds are their de-quantization, whatever the model's were). q/k rows carry
    llama.cpp's RoPE permutation, which transformers undoes on load."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)

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
    ftype = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}.get(qtype, qtype)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{ftype}"])
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
            kind = (qtypes or {}).get(name) or (
                embed_qtype if name == "token_embd.weight" else qtype)
            raw = (random_kquant(kind, *t.shape, float(t.std()), rng) if kind.endswith("_K")
                   else gguf.quants.quantize(t, Q[kind]))
            w.add_tensor(name, raw, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# K-quant super-blocks: where ggml keeps the fp16 d (and dmin), and d so that the weights'
# spread is about the tensor's (q ∈ 0..15 / 0..31 times 6-bit scales, minus dmin·mn with
# dmin = mean q·d to centre them; Q6_K: int8 scales times q ∈ −32..31)
KQUANT_F16 = {"Q4_K": ((0, 1 / 150), (2, 7.5 / 150)), "Q5_K": ((0, 1 / 300), (2, 15.5 / 300)),
              "Q6_K": ((208, 1 / 1300),)}


def random_kquant(kind: str, rows: int, cols: int, std: float, rng) -> np.ndarray:
    """Random but valid raw Q4_K / Q5_K / Q6_K blocks (uint8 [rows, bytes]): random quants and
    sub-block scales (and mins), fp16 d (and dmin) of random size around `std`'s scale."""
    import gguf

    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at, factor in KQUANT_F16[kind]:
        d = std * factor * 2.0 ** rng.uniform(-1, 1, (rows, cols // per))
        raw[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def word_tokenizer(n: int) -> PreTrainedTokenizerFast:
    """A whitespace word tokenizer over n words w0..w{n-1} (w0 doubles as unk and EOS), for
    models whose vocabulary is small enough to enumerate every 3-token continuation."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w0")


def word_level_tokenizer(words: int = 316) -> PreTrainedTokenizerFast:
    """A word-level vocabulary of its own, as a user's small model may have: `<pad> </s> <unk>
    <s>` and the words w0..w{words-1}, split on whitespace and punctuation. Real text is all
    `<unk>`; transformers' Qwen2 tokenizer class, which rebuilds a byte-level BPE from the
    vocabulary, encodes it as no token at all."""
    specials = ["<pad>", "</s>", "<unk>", "<s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", bos_token="<s>")


def exact_joint_hf(model_dir, prompt, params, vocab: int):
    """P(first 3 new tokens) of the Hugging Face model saved in `model_dir` under target-only
    sampling with `params`, by enumerating every 2-token prefix (vocab² forwards)."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from spec_runtime import warp

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    joint = np.zeros((vocab,) * 3)
    with torch.no_grad():
        for a in range(vocab):
            for b in range(vocab):
                logits = hf(torch.tensor([list(prompt) + [a, b]])).logits[0, -3:].double().numpy()
                rows = warp(logits, params)
                joint[a, b] = rows[0, a] * rows[1, b] * rows[2]
    return joint


def window_shifted(module, shift: int | None):
    """A models/ decoder with each sliding layer's window moved by `shift` keys (None: no
    window at all): what an off-by-one in the window would compute."""
    for layer in module.layers:
        if layer.window is not None:
            layer.window = None if shift is None else layer.window + shift
    return module


def truncated(model, layers: int):
    """The first `layers` blocks of `model` with its embeddings and head: a smaller draft that
    agrees with the target often enough for acceptances to be exercised."""
    fields = {**model.config.to_dict(), "num_hidden_layers": layers}
    if fields.get("layer_types"):
        fields["layer_types"] = fields["layer_types"][:layers]
    cfg = model.config.__class__(**fields)
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


# Whisper's special tokens, in its order, after the 256 bytes (ids 256 ..): what a
# multilingual Whisper's generate reads from generation_config
WHISPER_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|de|>",
                    "<|translate|>", "<|transcribe|>", "<|notimestamps|>"]
WHISPER_VOCAB = 256 + len(WHISPER_SPECIALS)


# with timestamps: <|startofprev|> and <|nospeech|> before <|notimestamps|>, then the timestamp
# tokens <|0.00|> .. of a window of 2 * 16 frames (0.32 s)
WHISPER_TS_SPECIALS = WHISPER_SPECIALS[:-1] + ["<|startofprev|>", "<|nospeech|>",
                                               "<|notimestamps|>"] + \
    [f"<|{i * 0.02:.2f}|>" for i in range(17)]


def whisper_tokenizer(specials=WHISPER_SPECIALS) -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: the 256 bytes at ids 0..255, then Whisper's specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def whisper(seed: int, d_model=32, layers=2, heads=4, positions=16, suppress=(),
            begin_suppress=(), max_target_positions=64, timestamps=False,
            max_initial_timestamp_index=None, **kw):
    """A tiny multilingual Whisper (80 mel bins, a window of 2 * `positions` frames) whose
    generation_config carries what Whisper's `generate` reads: languages, tasks,
    <|notimestamps|>, the suppressed tokens; with `timestamps`, the vocabulary of
    WHISPER_TS_SPECIALS (whisper_tokenizer(WHISPER_TS_SPECIALS)) and <|startofprev|>."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    specials = WHISPER_TS_SPECIALS if timestamps else WHISPER_SPECIALS
    ids = {s: 256 + i for i, s in enumerate(specials)}
    extra = {"prev_sot_token_id": ids["<|startofprev|>"],
             "max_initial_timestamp_index": max_initial_timestamp_index} if timestamps else {}
    cfg = WhisperConfig(
        vocab_size=256 + len(specials), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, num_mel_bins=80, max_source_positions=positions,
        max_target_positions=max_target_positions, decoder_start_token_id=ids["<|startoftranscript|>"],
        pad_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"], suppress_tokens=list(suppress),
        begin_suppress_tokens=list(begin_suppress), init_std=0.2, **kw)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # the prompt's tokens weigh: another language, another transcript
        model.model.decoder.embed_tokens.weight[256:] *= 8
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
        max_length=max_target_positions, is_multilingual=True,
        lang_to_id={s: ids[s] for s in ("<|en|>", "<|fr|>", "<|de|>")},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], suppress_tokens=list(suppress),
        begin_suppress_tokens=list(begin_suppress), **extra)
    return model


def truncated_whisper(model, layers: int):
    """The first `layers` decoder blocks of a Whisper (its whole encoder), with its generation
    config: a draft that agrees with it often."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig.from_dict({**model.config.to_dict(), "decoder_layers": layers})
    small = WhisperForConditionalGeneration(cfg).eval()
    state = {k: v for k, v in model.state_dict().items()
             if ".decoder.layers." not in k or int(k.split(".decoder.layers.")[1].split(".")[0]) < layers}
    small.load_state_dict(state, strict=False)
    small.generation_config = model.generation_config
    return small
