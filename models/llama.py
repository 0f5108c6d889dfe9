"""Export-friendly Llama forward over Hugging Face `LlamaForCausalLM` weights.

Covers the SmolLM2 / TinyLlama / Llama 2 / Llama 3 layouts: grouped-query attention, tied or
untied embeddings, RoPE types "default", "linear" and "llama3". In the spirit of gpt-fast's
model.py, but the KV cache lives outside the graph (see models/common.py for the contract).

The families built on the same block (qwen2.py, qwen3.py, mistral.py, gemma3.py) subclass
`Llama` and say how they differ in `LlamaDims`: biases, q/k norms, Gemma's sandwich norms and
GELU, an embedding scale, the attention scale, a sliding window and a RoPE table per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .common import (CachedDecoder, UnsupportedModel, WeightMap, cached_attention, param, rms_norm,
                     step_masks)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaDims:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # what the other families change; the defaults are Llama's
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too (Gemma 3)
    act: str = "silu"  # "silu" or "gelu_tanh" (Gemma)
    embed_scale: float | None = None  # the embedding is multiplied by it (Gemma: sqrt(dim))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    # per layer: the sliding window (HF's: a query at i sees keys i - window < j <= i), None for
    # global attention; and the index of its RoPE table. Empty: every layer global, table 0
    windows: tuple[int | None, ...] = ()
    rope_of_layer: tuple[int, ...] = ()

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def rope(self, layer: int) -> int:
        return self.rope_of_layer[layer] if self.rope_of_layer else 0

    @classmethod
    def from_config(cls, c, family: str = "llama", **changes) -> "LlamaDims":
        """Llama's reading of config `c`; `changes` are the family's own fields."""
        act = getattr(c, "hidden_act", "silu")
        if "act" not in changes and act != "silu":
            raise UnsupportedModel(f"{family}: hidden_act={act!r} not supported (only 'silu')")
        if getattr(c, "pretraining_tp", 1) not in (None, 1):
            # pretraining_tp > 1 only changes HF's matmul split order, i.e. rounding; refuse rather
            # than report a parity gap that is not ours
            raise UnsupportedModel(f"{family}: pretraining_tp={c.pretraining_tp} not supported (needs 1)")
        n_kv = c.num_key_value_heads or c.num_attention_heads
        if c.num_attention_heads % n_kv:
            raise UnsupportedModel(f"{family}: {c.num_attention_heads} heads not a multiple of {n_kv} kv heads")
        bias = bool(getattr(c, "attention_bias", False))
        fields = dict(
            vocab_size=c.vocab_size,
            dim=c.hidden_size,
            n_layers=c.num_hidden_layers,
            n_heads=c.num_attention_heads,
            n_kv_heads=n_kv,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            ffn_dim=c.intermediate_size,
            norm_eps=c.rms_norm_eps,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
        )
        return cls(**{**fields, **changes})


def layer_windows(c, family: str, max_len: int) -> tuple[int | None, ...]:
    """Per layer, the sliding window HF applies, from `config.layer_types` (Qwen2, Qwen3,
    Gemma 3: "sliding_attention" layers use `config.sliding_window`, "full_attention" none).
    A window of max_len or more never hides a key from a cache of max_len slots: None."""
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise UnsupportedModel(f"{family}: layer types {other} not supported; supported: "
                               f"full_attention, sliding_attention")
    window = getattr(c, "sliding_window", None)
    if "sliding_attention" in types and not window:
        raise UnsupportedModel(f"{family}: sliding_attention layers without a sliding_window")
    return tuple(window if t == "sliding_attention" and window < max_len else None for t in types)


def rope_parameters(config) -> dict:
    """transformers 5 keeps theta and scaling in `config.rope_parameters`; 4.x used `rope_theta`
    plus an optional `rope_scaling` dict (with "type" in old checkpoints). Both are read."""
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def rope_inv_freq(config, head_dim: int, rp: dict | None = None,
                  family: str = "llama") -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], as transformers computes them for the supported types,
    from the RoPE parameters `rp` (default: the config's one set)."""
    rp = rope_parameters(config) if rp is None else rp
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"{family}: rope type {rope_type!r} not supported; supported: {list(SUPPORTED_ROPE_TYPES)}. "
            "Dynamic / yarn / longrope rescale with sequence length and need another graph."
        )
    if rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) not in (None, 1.0):
        raise UnsupportedModel(f"{family}: partial_rotary_factor != 1 not supported")
    theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        # scaling positions by 1/factor == scaling the frequencies by 1/factor
        return inv_freq / rp["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old_len = rp.get("original_max_position_embeddings", config.max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_table(inv_freq: torch.Tensor, length: int) -> torch.Tensor:
    """Angles [length, D] for positions 0..length-1, both halves (HF's rotate_half layout)."""
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
    return torch.cat([freqs, freqs], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, D], cos/sin [n, D]; HF's rotate_half layout (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaBlock(nn.Module):
    def __init__(self, d: LlamaDims, layer: int):
        super().__init__()
        self.d = d
        self.window = d.window(layer)  # None: global attention
        self.rope = d.rope(layer)  # which of the model's RoPE tables

    def forward(self, x, cos, sin, past_k, past_v, past_len, causal):
        d = self.d
        g = d.n_heads // d.n_kv_heads
        h = rms_norm(x, self.attn_norm, d.norm_eps)
        # q, k and v in one MatMul (weights concatenated at load): one pass over h, one kernel
        qkv = F.linear(h, self.wqkv, self.bqkv)  # [1, n, (H + 2*KVH) * D]
        # slices, not torch.split: opset-18 Split (num_outputs) has no down-converter to 17
        qd, kvd = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
        q, k, v = qkv[..., :qd], qkv[..., qd : qd + kvd], qkv[..., qd + kvd :]
        # HF head h reads kv head h // G (repeat_kv), so heads split as (KVH, G)
        q = q.reshape(1, -1, d.n_kv_heads, g, d.head_dim)  # [1, n, KVH, G, D]
        k = k.reshape(1, -1, d.n_kv_heads, d.head_dim)  # [1, n, KVH, D]
        if d.qk_norm:  # each head's q and k normalised over D, before RoPE
            q = rms_norm(q, self.q_norm, d.norm_eps)
            k = rms_norm(k, self.k_norm, d.norm_eps)
        q = q.permute(0, 2, 3, 1, 4)  # [1, KVH, G, n, D]
        k = k.transpose(1, 2)  # [1, KVH, n, D]
        v = v.reshape(1, -1, d.n_kv_heads, d.head_dim).transpose(1, 2)  # [1, KVH, n, D]
        q = apply_rope(q, cos, sin) * d.scale
        k = apply_rope(k, cos, sin)  # the cache holds K after RoPE
        a = cached_attention(q, k, v, past_k, past_v, past_len, causal,
                             window=self.window)  # [1, KVH, G, n, D]
        a = a.permute(0, 3, 1, 2, 4).reshape(1, -1, d.n_heads * d.head_dim)  # [1, n, H*D]
        o = F.linear(a, self.wo, self.bo)
        if d.sandwich_norms:
            o = rms_norm(o, self.post_attn_norm, d.norm_eps)
        x = x + o
        h = rms_norm(x, self.ffn_norm, d.norm_eps)
        gate_up = F.linear(h, self.w_gate_up, self.b_gate_up)  # [1, n, 2F]
        gate, up = gate_up[..., : d.ffn_dim], gate_up[..., d.ffn_dim :]
        act = F.silu(gate) if d.act == "silu" else F.gelu(gate, approximate="tanh")
        y = F.linear(act * up, self.w_down, self.b_down)
        if d.sandwich_norms:
            y = rms_norm(y, self.post_ffn_norm, d.norm_eps)
        return x + y, k, v


class Llama(CachedDecoder):
    model_type = "llama"
    # added to every RMSNorm weight at load: Gemma stores w and multiplies by (1 + w)
    norm_offset = 0.0

    def __init__(self, d: LlamaDims, inv_freqs: list[torch.Tensor], max_len: int):
        super().__init__()
        self.d = d
        self.n_layers, self.n_kv_heads, self.head_dim = d.n_layers, d.n_kv_heads, d.head_dim
        self.max_len, self.vocab_size = max_len, d.vocab_size
        # per RoPE table [D/2]; the fused writer tabulates its own (longer) cos/sin from them
        self.inv_freqs = list(inv_freqs)
        for j, inv_freq in enumerate(self.inv_freqs):
            emb = rope_table(inv_freq, max_len)  # [L, D]
            # gathered at position + arange(n) in the graph; cos/sin computed here once, in float32
            self.register_buffer(f"rope_cos_{j}", emb.cos(), persistent=False)
            self.register_buffer(f"rope_sin_{j}", emb.sin(), persistent=False)
        if d.embed_scale is not None:  # a float32 scalar, as HF multiplies by it
            self.register_buffer("embed_scale", torch.tensor(d.embed_scale, dtype=torch.float32),
                                 persistent=False)
        self.layers = nn.ModuleList(LlamaBlock(d, i) for i in range(d.n_layers))

    def forward(self, input_ids, position, num_logits, *past):
        n = input_ids.shape[1]
        x = F.embedding(input_ids, self.embed)  # [1, n, C]
        if self.d.embed_scale is not None:
            x = x * self.embed_scale
        pos = position + torch.arange(n)  # [n]
        ropes = [(getattr(self, f"rope_cos_{j}").index_select(0, pos),
                  getattr(self, f"rope_sin_{j}").index_select(0, pos))  # [n, D] each
                 for j in range(len(self.inv_freqs))]
        past_len, causal = step_masks(n, position, self.max_len)
        present = []
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[layer.rope]
            x, k, v = layer(x, cos, sin, past[2 * i], past[2 * i + 1], past_len, causal)
            present += [k, v]
        # slice before the norm and lm_head: a prefill chunk pays the lm_head only for its last rows
        x = x[:, n - num_logits :]  # [1, num_logits, C]
        logits = F.linear(rms_norm(x, self.norm, self.d.norm_eps), self.lm_head)  # [1, num_logits, V]
        return (logits, *present)

    def trim_lm_head(self, ids) -> None:
        super().trim_lm_head(ids)
        self.d = replace(self.d, vocab_size=self.vocab_size)  # the fused writer's logits width

    # -- what a family changes --------------------------------------------------------------

    @classmethod
    def dims(cls, config, max_len: int) -> LlamaDims:
        return LlamaDims.from_config(config)

    @classmethod
    def rope_sets(cls, config) -> list[tuple[str, dict]]:
        """Per RoPE table: (the prefix of its `inv_freq` on HF's rotary_emb, its parameters)."""
        return [("", rope_parameters(config))]

    @classmethod
    def text_model(cls, hf_model):
        """(config, the HF module holding rotary_emb, state dict with `model.` / `lm_head.`
        names) of the language model to export."""
        return hf_model.config, getattr(hf_model, "model", None), hf_model.state_dict()

    # -----------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_model, max_len: int) -> "Llama":
        cfg, body, state_dict = cls.text_model(hf_model)
        d = cls.dims(cfg, max_len)
        sets = cls.rope_sets(cfg)
        inv_freqs = [rope_inv_freq(cfg, d.head_dim, rp, cls.model_type) for _, rp in sets]
        hf_rope = getattr(body, "rotary_emb", None)
        for (prefix, _), inv_freq in zip(sets, inv_freqs) if hf_rope is not None else ():
            # our frequencies must be HF's; a mismatch means a rope variant we do not model
            hf_inv = getattr(hf_rope, prefix + "inv_freq").float().cpu()
            if not torch.allclose(hf_inv, inv_freq, rtol=1e-6, atol=0):
                raise UnsupportedModel(f"{cls.model_type}: computed RoPE frequencies differ from "
                                       f"the HF model's rotary_emb.{prefix}inv_freq")
            scaling = getattr(hf_rope, prefix + "attention_scaling", 1.0)
            if scaling != 1.0:
                raise UnsupportedModel(f"{cls.model_type}: RoPE attention_scaling={scaling} not supported")
        m = cls(d, inv_freqs, max_len)
        m.load_hf_state_dict(state_dict)
        return m.eval()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        d = self.d
        w = WeightMap(sd, self.model_type)
        C, D, F_ = d.dim, d.head_dim, d.ffn_dim
        qd, kvd = d.n_heads * D, d.n_kv_heads * D

        def norm(name: str, size: int = C):
            t = w.take(name, (size,))
            return param(t + self.norm_offset if self.norm_offset else t)

        self.embed = param(w.take("model.embed_tokens.weight", (d.vocab_size, C)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.attn_norm = norm(p + "input_layernorm.weight")
            # HF nn.Linear weights are [out, in], which is what F.linear wants: no transposes here
            wq = w.take(p + "self_attn.q_proj.weight", (qd, C))
            wk = w.take(p + "self_attn.k_proj.weight", (kvd, C))
            wv = w.take(p + "self_attn.v_proj.weight", (kvd, C))
            layer.wqkv = param(torch.cat([wq, wk, wv], 0))  # [qd + 2*kvd, C]
            layer.wo = param(w.take(p + "self_attn.o_proj.weight", (C, qd)))
            layer.bqkv = layer.bo = None
            if d.qkv_bias:
                bq = w.take(p + "self_attn.q_proj.bias", (qd,))
                bk = w.take(p + "self_attn.k_proj.bias", (kvd,))
                bv = w.take(p + "self_attn.v_proj.bias", (kvd,))
                layer.bqkv = param(torch.cat([bq, bk, bv]))
            if d.o_bias:
                layer.bo = param(w.take(p + "self_attn.o_proj.bias", (C,)))
            layer.q_norm = layer.k_norm = None
            if d.qk_norm:
                layer.q_norm = norm(p + "self_attn.q_norm.weight", D)
                layer.k_norm = norm(p + "self_attn.k_norm.weight", D)
            layer.post_attn_norm = layer.post_ffn_norm = None
            if d.sandwich_norms:  # Gemma: post_attention_layernorm is on the attention output
                layer.post_attn_norm = norm(p + "post_attention_layernorm.weight")
                layer.ffn_norm = norm(p + "pre_feedforward_layernorm.weight")
                layer.post_ffn_norm = norm(p + "post_feedforward_layernorm.weight")
            else:
                layer.ffn_norm = norm(p + "post_attention_layernorm.weight")
            wg = w.take(p + "mlp.gate_proj.weight", (F_, C))
            wu = w.take(p + "mlp.up_proj.weight", (F_, C))
            layer.w_gate_up = param(torch.cat([wg, wu], 0))  # [2F, C], gate rows first
            layer.w_down = param(w.take(p + "mlp.down_proj.weight", (C, F_)))
            if d.mlp_bias:
                bg = w.take(p + "mlp.gate_proj.bias", (F_,))
                bu = w.take(p + "mlp.up_proj.bias", (F_,))
                layer.b_gate_up = param(torch.cat([bg, bu]))
                layer.b_down = param(w.take(p + "mlp.down_proj.bias", (C,)))
            else:
                layer.b_gate_up = layer.b_down = None
        self.norm = norm("model.norm.weight")
        if d.tied:
            # a tied checkpoint may or may not list lm_head.weight; if it does it must be the embedding
            head = w.take_optional("lm_head.weight", (d.vocab_size, C))
            if head is not None and not torch.equal(head, self.embed.data):
                raise UnsupportedModel(f"{self.model_type}: tie_word_embeddings=True but "
                                       f"lm_head.weight differs from embed_tokens")
            self.lm_head = self.embed  # one tensor, so the ONNX file stores it once
        else:
            self.lm_head = param(w.take("lm_head.weight", (d.vocab_size, C)))
        w.finish()
