"""Export-friendly GPT-2 forward over Hugging Face `GPT2LMHeadModel` weights.

Learned absolute position embeddings (so max_len <= n_positions), pre-LayerNorm blocks, MHA
(every head has its own K/V: kv_heads == heads, G == 1 in models/common.cached_attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import (CachedDecoder, UnsupportedModel, WeightMap, cached_attention, param,
                     step_masks)

# HF activation name -> F.gelu's `approximate`
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GPT2Dims:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_positions: int
    ffn_dim: int
    norm_eps: float
    gelu_approx: str
    scale_attn: bool
    scale_by_layer: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_config(cls, c) -> "GPT2Dims":
        if c.activation_function not in _GELU:
            raise UnsupportedModel(f"gpt2: activation {c.activation_function!r} not supported; supported: {list(_GELU)}")
        if not getattr(c, "tie_word_embeddings", True):
            raise UnsupportedModel("gpt2: untied lm_head not supported (GPT-2 checkpoints are tied)")
        return cls(
            vocab_size=c.vocab_size,
            dim=c.n_embd,
            n_layers=c.n_layer,
            n_heads=c.n_head,
            n_positions=c.n_positions,
            ffn_dim=c.n_inner or 4 * c.n_embd,
            norm_eps=c.layer_norm_epsilon,
            gelu_approx=_GELU[c.activation_function],
            scale_attn=bool(c.scale_attn_weights),
            scale_by_layer=bool(c.scale_attn_by_inverse_layer_idx),
        )


class GPT2Block(nn.Module):
    def __init__(self, d: GPT2Dims, layer_idx: int):
        super().__init__()
        self.d = d
        scale = d.head_dim**-0.5 if d.scale_attn else 1.0
        self.scale = scale / (layer_idx + 1) if d.scale_by_layer else scale

    def forward(self, x, past_k, past_v, past_len, causal):
        d = self.d
        h = F.layer_norm(x, (d.dim,), self.ln1_w, self.ln1_b, d.norm_eps)
        qkv = F.linear(h, self.w_qkv, self.b_qkv)  # [1, n, 3C]
        q, k, v = qkv[..., : d.dim], qkv[..., d.dim : 2 * d.dim], qkv[..., 2 * d.dim :]  # not Split: see llama.py
        q = q.reshape(1, -1, d.n_heads, 1, d.head_dim).permute(0, 2, 3, 1, 4) * self.scale  # [1, H, 1, n, D]
        k = k.reshape(1, -1, d.n_heads, d.head_dim).transpose(1, 2)  # [1, H, n, D]
        v = v.reshape(1, -1, d.n_heads, d.head_dim).transpose(1, 2)  # [1, H, n, D]
        a = cached_attention(q, k, v, past_k, past_v, past_len, causal)  # [1, H, 1, n, D]
        a = a.permute(0, 3, 1, 2, 4).reshape(1, -1, d.dim)  # [1, n, C]
        x = x + F.linear(a, self.w_attn_out, self.b_attn_out)
        h = F.layer_norm(x, (d.dim,), self.ln2_w, self.ln2_b, d.norm_eps)
        h = F.gelu(F.linear(h, self.w_fc, self.b_fc), approximate=d.gelu_approx)
        return x + F.linear(h, self.w_mlp_out, self.b_mlp_out), k, v


class GPT2(CachedDecoder):
    model_type = "gpt2"

    def __init__(self, d: GPT2Dims, max_len: int):
        super().__init__()
        if max_len > d.n_positions:
            raise UnsupportedModel(
                f"gpt2: max_len={max_len} exceeds n_positions={d.n_positions}; learned position "
                f"embeddings stop there. Use max_len <= {d.n_positions}."
            )
        self.d = d
        self.n_layers, self.n_kv_heads, self.head_dim = d.n_layers, d.n_heads, d.head_dim
        self.max_len, self.vocab_size = max_len, d.vocab_size
        self.layers = nn.ModuleList(GPT2Block(d, i) for i in range(d.n_layers))

    def forward(self, input_ids, position, num_logits, *past):
        n = input_ids.shape[1]
        pos = position + torch.arange(n)  # [n]
        x = F.embedding(input_ids, self.wte) + F.embedding(pos, self.wpe)  # [1, n, C]
        past_len, causal = step_masks(n, position, self.max_len)
        present = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, past[2 * i], past[2 * i + 1], past_len, causal)
            present += [k, v]
        x = x[:, n - num_logits :]  # [1, num_logits, C]: lm_head only for the rows asked for
        x = F.layer_norm(x, (self.d.dim,), self.ln_f_w, self.ln_f_b, self.d.norm_eps)
        return (F.linear(x, self.lm_head), *present)  # tied: lm_head is wte unless untied

    @classmethod
    def from_hf(cls, hf_model, max_len: int) -> "GPT2":
        m = cls(GPT2Dims.from_config(hf_model.config), max_len)
        m.load_hf_state_dict(hf_model.state_dict())
        return m.eval()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        d = self.d
        # transformers < 4.3x kept the causal mask as attn.bias / attn.masked_bias buffers in the
        # state dict; they are not weights, and step_masks builds our own
        sd = {k: v for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        w = WeightMap(sd, "gpt2")
        C, F_ = d.dim, d.ffn_dim

        # GPT-2 uses HF's Conv1D, which computes x @ W + b with W stored [in, out]: the transpose
        # of nn.Linear's [out, in]. We transpose once here so every projection is F.linear.
        def conv1d(name: str, n_in: int, n_out: int) -> tuple[nn.Parameter, nn.Parameter]:
            weight = w.take(name + ".weight", (n_in, n_out)).t().contiguous()  # [out, in]
            return param(weight), param(w.take(name + ".bias", (n_out,)))

        self.wte = param(w.take("transformer.wte.weight", (d.vocab_size, C)))
        self.embed = self.lm_head = self.wte  # one tensor, stored once in the graph
        # only the first max_len rows can ever be gathered; keep the file small
        self.wpe = param(w.take("transformer.wpe.weight", (d.n_positions, C))[: self.max_len].clone())
        for i, layer in enumerate(self.layers):
            p = f"transformer.h.{i}."
            layer.ln1_w = param(w.take(p + "ln_1.weight", (C,)))
            layer.ln1_b = param(w.take(p + "ln_1.bias", (C,)))
            layer.w_qkv, layer.b_qkv = conv1d(p + "attn.c_attn", C, 3 * C)  # out = [q | k | v]
            layer.w_attn_out, layer.b_attn_out = conv1d(p + "attn.c_proj", C, C)
            layer.ln2_w = param(w.take(p + "ln_2.weight", (C,)))
            layer.ln2_b = param(w.take(p + "ln_2.bias", (C,)))
            layer.w_fc, layer.b_fc = conv1d(p + "mlp.c_fc", C, F_)
            layer.w_mlp_out, layer.b_mlp_out = conv1d(p + "mlp.c_proj", F_, C)
        self.ln_f_w = param(w.take("transformer.ln_f.weight", (C,)))
        self.ln_f_b = param(w.take("transformer.ln_f.bias", (C,)))
        head = w.take_optional("lm_head.weight", (d.vocab_size, C))
        if head is not None and not torch.equal(head, self.wte.data):
            raise UnsupportedModel("gpt2: lm_head.weight differs from transformer.wte.weight (expected tied)")
        w.finish()
