"""Export-friendly Llama forward over Hugging Face `LlamaForCausalLM` weights.

Covers the SmolLM2 / TinyLlama / Llama 2 / Llama 3 layouts: grouped-query attention, tied or
untied embeddings, RoPE types "default", "linear" and "llama3". In the spirit of gpt-fast's
model.py, but the KV cache lives outside the graph (see models/common.py for the contract).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, c) -> "LlamaDims":
        if getattr(c, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"llama: hidden_act={c.hidden_act!r} not supported (only 'silu')")
        if getattr(c, "pretraining_tp", 1) not in (None, 1):
            # pretraining_tp > 1 only changes HF's matmul split order, i.e. rounding; refuse rather
            # than report a parity gap that is not ours
            raise UnsupportedModel(f"llama: pretraining_tp={c.pretraining_tp} not supported (needs 1)")
        n_kv = c.num_key_value_heads or c.num_attention_heads
        if c.num_attention_heads % n_kv:
            raise UnsupportedModel(f"llama: {c.num_attention_heads} heads not a multiple of {n_kv} kv heads")
        return cls(
            vocab_size=c.vocab_size,
            dim=c.hidden_size,
            n_layers=c.num_hidden_layers,
            n_heads=c.num_attention_heads,
            n_kv_heads=n_kv,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            ffn_dim=c.intermediate_size,
            norm_eps=c.rms_norm_eps,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
        )


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], as transformers computes them for the supported types.

    transformers 5 keeps theta and scaling in `config.rope_parameters`; 4.x used `rope_theta` plus
    an optional `rope_scaling` dict (with "type" in old checkpoints). Both are read.
    """
    rp = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"llama: rope type {rope_type!r} not supported; supported: {list(SUPPORTED_ROPE_TYPES)}. "
            "Dynamic / yarn / longrope rescale with sequence length and need another graph."
        )
    if rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) not in (None, 1.0):
        raise UnsupportedModel("llama: partial_rotary_factor != 1 not supported")
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
    def __init__(self, d: LlamaDims):
        super().__init__()
        self.d = d
        self.scale = d.head_dim**-0.5

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
        q = q.reshape(1, -1, d.n_kv_heads, g, d.head_dim).permute(0, 2, 3, 1, 4)  # [1, KVH, G, n, D]
        k = k.reshape(1, -1, d.n_kv_heads, d.head_dim).transpose(1, 2)  # [1, KVH, n, D]
        v = v.reshape(1, -1, d.n_kv_heads, d.head_dim).transpose(1, 2)  # [1, KVH, n, D]
        q = apply_rope(q, cos, sin) * self.scale
        k = apply_rope(k, cos, sin)  # the cache holds K after RoPE
        a = cached_attention(q, k, v, past_k, past_v, past_len, causal)  # [1, KVH, G, n, D]
        a = a.permute(0, 3, 1, 2, 4).reshape(1, -1, d.n_heads * d.head_dim)  # [1, n, H*D]
        x = x + F.linear(a, self.wo, self.bo)
        h = rms_norm(x, self.ffn_norm, d.norm_eps)
        gate_up = F.linear(h, self.w_gate_up, self.b_gate_up)  # [1, n, 2F]
        gate, up = gate_up[..., : d.ffn_dim], gate_up[..., d.ffn_dim :]
        x = x + F.linear(F.silu(gate) * up, self.w_down, self.b_down)
        return x, k, v


class Llama(CachedDecoder):
    model_type = "llama"

    def __init__(self, d: LlamaDims, inv_freq: torch.Tensor, max_len: int):
        super().__init__()
        self.d = d
        self.n_layers, self.n_kv_heads, self.head_dim = d.n_layers, d.n_kv_heads, d.head_dim
        self.max_len, self.vocab_size = max_len, d.vocab_size
        self.inv_freq = inv_freq  # [D/2]; the fused writer tabulates its own (longer) cos/sin
        emb = rope_table(inv_freq, max_len)  # [L, D]
        # gathered at position + arange(n) in the graph; cos/sin computed here once, in float32
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        self.layers = nn.ModuleList(LlamaBlock(d) for _ in range(d.n_layers))

    def forward(self, input_ids, position, num_logits, *past):
        n = input_ids.shape[1]
        x = F.embedding(input_ids, self.embed)  # [1, n, C]
        pos = position + torch.arange(n)  # [n]
        cos, sin = self.rope_cos.index_select(0, pos), self.rope_sin.index_select(0, pos)  # [n, D]
        past_len, causal = step_masks(n, position, self.max_len)
        present = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, past[2 * i], past[2 * i + 1], past_len, causal)
            present += [k, v]
        # slice before the norm and lm_head: a prefill chunk pays the lm_head only for its last rows
        x = x[:, n - num_logits :]  # [1, num_logits, C]
        logits = F.linear(rms_norm(x, self.norm, self.d.norm_eps), self.lm_head)  # [1, num_logits, V]
        return (logits, *present)

    @classmethod
    def from_hf(cls, hf_model, max_len: int) -> "Llama":
        cfg = hf_model.config
        d = LlamaDims.from_config(cfg)
        inv_freq = rope_inv_freq(cfg, d.head_dim)
        hf_rope = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
        if hf_rope is not None:
            # our frequencies must be HF's; a mismatch means a rope variant we do not model
            if not torch.allclose(hf_rope.inv_freq.float().cpu(), inv_freq, rtol=1e-6, atol=0):
                raise UnsupportedModel("llama: computed RoPE frequencies differ from the HF model's rotary_emb.inv_freq")
            if getattr(hf_rope, "attention_scaling", 1.0) != 1.0:
                raise UnsupportedModel(f"llama: RoPE attention_scaling={hf_rope.attention_scaling} not supported")
        m = cls(d, inv_freq, max_len)
        m.load_hf_state_dict(hf_model.state_dict())
        return m.eval()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        d = self.d
        w = WeightMap(sd, "llama")
        C, D, F_ = d.dim, d.head_dim, d.ffn_dim
        qd, kvd = d.n_heads * D, d.n_kv_heads * D
        self.embed = param(w.take("model.embed_tokens.weight", (d.vocab_size, C)))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.attn_norm = param(w.take(p + "input_layernorm.weight", (C,)))
            # HF nn.Linear weights are [out, in], which is what F.linear wants: no transposes here
            wq = w.take(p + "self_attn.q_proj.weight", (qd, C))
            wk = w.take(p + "self_attn.k_proj.weight", (kvd, C))
            wv = w.take(p + "self_attn.v_proj.weight", (kvd, C))
            layer.wqkv = param(torch.cat([wq, wk, wv], 0))  # [qd + 2*kvd, C]
            layer.wo = param(w.take(p + "self_attn.o_proj.weight", (C, qd)))
            if d.attention_bias:
                bq = w.take(p + "self_attn.q_proj.bias", (qd,))
                bk = w.take(p + "self_attn.k_proj.bias", (kvd,))
                bv = w.take(p + "self_attn.v_proj.bias", (kvd,))
                layer.bqkv = param(torch.cat([bq, bk, bv]))
                layer.bo = param(w.take(p + "self_attn.o_proj.bias", (C,)))
            else:
                layer.bqkv = layer.bo = None
            layer.ffn_norm = param(w.take(p + "post_attention_layernorm.weight", (C,)))
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
        self.norm = param(w.take("model.norm.weight", (C,)))
        if d.tied:
            # a tied checkpoint may or may not list lm_head.weight; if it does it must be the embedding
            head = w.take_optional("lm_head.weight", (d.vocab_size, C))
            if head is not None and not torch.equal(head, self.embed.data):
                raise UnsupportedModel("llama: tie_word_embeddings=True but lm_head.weight differs from embed_tokens")
            self.lm_head = self.embed  # one tensor, so the ONNX file stores it once
        else:
            self.lm_head = param(w.take("lm_head.weight", (d.vocab_size, C)))
        w.finish()
