"""Export-friendly T5 over Hugging Face `T5ForConditionalGeneration` weights, as two graphs.

Covers both layouts:
  v1.0 (t5-small ...)        ReLU FFN `DenseReluDense.wi/wo`, lm_head tied to the embedding and
                             the decoder output rescaled by d_model**-0.5 before it;
  v1.1 / flan-t5             gated-GELU FFN `wi_0/wi_1/wo`, untied lm_head, no rescale.

    encoder   input_ids, attention_mask [1, S] (S = max_source_len, static; source right-padded)
              -> cross_key.{i} / cross_value.{i} [1, H, S, D] for every DECODER layer i
    decoder   the decoder-only contract of models/common.py plus cross_key/value.{i} and
              source_mask [1, S]: the cross-attention K/V are computed once per request, in the
              encoder graph, and read by every decoder call.

T5 attention has no 1/sqrt(D) scaling and no absolute positions: every self-attention adds a
learned bias looked up by bucketed relative position (key − query), shared by all layers of a
stack. The buckets are computed here once, from the same float32 ops as Hugging Face, into a table
indexed by relative position; the graph only gathers from it, so no Log/Cast in the graph can
round a bucket boundary differently from PyTorch. Relative positions come from ABSOLUTE
positions (query = position + t; key = slot j of the cache, or position + t' for the new block),
which is what lets the decoder run over a static KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import (CachedDecoder, UnsupportedModel, WeightMap, cached_attention, causal_mask,
                     lane, lane_kv, lane_lengths, lane_rows, lanes_cat, param, rms_norm,
                     step_masks)

# HF activation name (config.dense_act_fn) -> our function
_ACT = {
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class T5Dims:
    vocab_size: int
    dim: int  # d_model
    n_heads: int
    head_dim: int  # d_kv; n_heads * d_kv need not equal d_model
    ffn_dim: int
    n_enc_layers: int
    n_dec_layers: int
    num_buckets: int
    max_distance: int
    norm_eps: float
    act: str
    gated: bool
    scale_output: bool  # v1.0: decoder output * d_model**-0.5 before lm_head

    @property
    def inner(self) -> int:
        return self.n_heads * self.head_dim

    @classmethod
    def from_config(cls, c) -> "T5Dims":
        act = getattr(c, "dense_act_fn", "relu")
        if act not in _ACT:
            raise UnsupportedModel(f"t5: feed_forward_proj={c.feed_forward_proj!r} not supported; "
                             f"supported activations: {sorted(_ACT)}")
        # transformers 5 records the v1.0 rescale as scale_decoder_outputs (and always sets
        # tie_word_embeddings=True); 4.x rescaled exactly when tie_word_embeddings was True
        scale = getattr(c, "scale_decoder_outputs", None)
        if scale is None:
            scale = bool(getattr(c, "tie_word_embeddings", True))
        return cls(
            vocab_size=c.vocab_size,
            dim=c.d_model,
            n_heads=c.num_heads,
            head_dim=c.d_kv,
            ffn_dim=c.d_ff,
            n_enc_layers=c.num_layers,
            n_dec_layers=c.num_decoder_layers if c.num_decoder_layers is not None else c.num_layers,
            num_buckets=c.relative_attention_num_buckets,
            max_distance=c.relative_attention_max_distance,
            norm_eps=c.layer_norm_epsilon,
            act=act,
            gated=bool(getattr(c, "is_gated_act", False)),
            scale_output=bool(scale),
        )


def relative_position_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Hugging Face's T5Attention._relative_position_bucket, op for op (eager only: log(0) on
    the small branch is computed and discarded, as there)."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0).to(torch.long) * num_buckets
        rel = torch.abs(rel)
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))  # keys after the query share bucket 0
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    large = max_exact + (
        torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, rel, large)


class RelativeBias(nn.Module):
    """Per-head bias for every relative position a graph can see, gathered by absolute positions.

    table[r + span - 1] = HF bias for relative position r = key − query, r in (−span, span).
    """

    def __init__(self, weight: torch.Tensor, span: int, bidirectional: bool, d: T5Dims):
        super().__init__()
        rel = torch.arange(-(span - 1), span)  # [2*span - 1]
        buckets = relative_position_bucket(rel, bidirectional, d.num_buckets, d.max_distance)
        self.span = span
        self.buckets = buckets  # kept for the cross-check against HF in T5.from_hf
        self.table = param(weight[buckets].clone())  # [2*span - 1, H]

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos [n], k_pos [m] absolute positions -> [1, H, n, m]."""
        idx = k_pos[None, :] - q_pos[:, None] + (self.span - 1)  # [n, m]
        return F.embedding(idx, self.table).permute(2, 0, 1).unsqueeze(0)


def _heads(x: torch.Tensor, d: T5Dims) -> torch.Tensor:
    return x.reshape(1, -1, d.n_heads, d.head_dim).transpose(1, 2)  # [1, n, H*D] -> [1, H, n, D]


def _merge(x: torch.Tensor, d: T5Dims) -> torch.Tensor:
    return x.transpose(1, 2).reshape(1, -1, d.inner)  # [1, H, n, D] -> [1, n, H*D]


def _masked_attention(q, k, v, ok, bias=None):
    """softmax(q kᵀ (+ bias), masked to -inf where not ok) v; q [1, H, n, D], k/v [1, H, m, D]."""
    s = q @ k.transpose(-1, -2)  # [1, H, n, m]; T5: no 1/sqrt(D)
    if bias is not None:
        s = s + bias
    s = torch.where(ok, s, torch.tensor(float("-inf"), dtype=s.dtype))
    return torch.softmax(s, dim=-1) @ v


class FeedForward(nn.Module):
    def __init__(self, d: T5Dims):
        super().__init__()
        self.d = d
        self.act = _ACT[d.act]

    def forward(self, h):
        if self.d.gated:
            gate_up = F.linear(h, self.w_in)  # [1, n, 2F], wi_0 (activated) rows first
            h = self.act(gate_up[..., : self.d.ffn_dim]) * gate_up[..., self.d.ffn_dim :]
        else:
            h = self.act(F.linear(h, self.w_in))
        return F.linear(h, self.w_out)

    def load(self, w: WeightMap, p: str) -> None:
        d = self.d
        if d.gated:
            wi0 = w.take(p + "DenseReluDense.wi_0.weight", (d.ffn_dim, d.dim))
            wi1 = w.take(p + "DenseReluDense.wi_1.weight", (d.ffn_dim, d.dim))
            self.w_in = param(torch.cat([wi0, wi1], 0))  # [2F, C]
        else:
            self.w_in = param(w.take(p + "DenseReluDense.wi.weight", (d.ffn_dim, d.dim)))
        self.w_out = param(w.take(p + "DenseReluDense.wo.weight", (d.dim, d.ffn_dim)))
        self.norm = param(w.take(p + "layer_norm.weight", (d.dim,)))


class EncoderBlock(nn.Module):
    def __init__(self, d: T5Dims):
        super().__init__()
        self.d = d
        self.ff = FeedForward(d)

    def forward(self, x, bias, ok):
        d = self.d
        h = rms_norm(x, self.attn_norm, d.norm_eps)
        qkv = F.linear(h, self.wqkv)  # [1, S, 3*H*D]
        q, k, v = (_heads(qkv[..., i * d.inner : (i + 1) * d.inner], d) for i in range(3))
        x = x + F.linear(_merge(_masked_attention(q, k, v, ok, bias), d), self.wo)
        return x + self.ff(rms_norm(x, self.ff.norm, d.norm_eps))


class T5Encoder(nn.Module):
    """input_ids, attention_mask int64 [1, S] -> (cross_key.0, cross_value.0, ...) [1, H, S, D].

    The decoder's cross-attention K and V projections of every layer run here, in one MatMul
    over the encoder output, so a decoder step never recomputes them.
    """

    def __init__(self, d: T5Dims, max_source_len: int):
        super().__init__()
        self.d = d
        self.max_source_len = max_source_len
        self.n_layers = d.n_dec_layers  # number of cross K/V pairs the graph returns
        self.n_heads, self.head_dim = d.n_heads, d.head_dim
        self.layers = nn.ModuleList(EncoderBlock(d) for _ in range(d.n_enc_layers))

    def forward(self, input_ids, attention_mask):
        d = self.d
        x = F.embedding(input_ids, self.embed)  # [1, S, C]
        pos = torch.arange(input_ids.shape[1])  # [S]
        bias = self.rel_bias(pos, pos)  # [1, H, S, S], bidirectional
        ok = (attention_mask != 0)[:, None, None, :]  # [1, 1, 1, S]: padded keys masked
        for layer in self.layers:
            x = layer(x, bias, ok)
        h = rms_norm(x, self.norm, d.norm_eps)
        kv = F.linear(h, self.w_cross_kv)  # [1, S, 2 * layers * H*D]: k.0 | v.0 | k.1 | ...
        return tuple(_heads(kv[..., j * d.inner : (j + 1) * d.inner], d) for j in range(2 * d.n_dec_layers))


class DecoderBlock(nn.Module):
    def __init__(self, d: T5Dims):
        super().__init__()
        self.d = d
        self.ff = FeedForward(d)

    def forward(self, x, causal, lanes: list):
        """x [L, n, C]; `lanes`: one (bias, past_k, past_v, past_len, cross_k, cross_v, src_ok)
        per lane (common.py, lanes) -> (x, [(k, v) of each lane's new slots])."""
        d, L = self.d, len(lanes)
        h = rms_norm(x, self.self_norm, d.norm_eps)
        qkv = F.linear(h, self.wqkv)  # [L, n, 3*H*D]
        outs, new = [], []
        for b, (bias, past_k, past_v, past_len, *_) in enumerate(lanes):
            row = lane(qkv, b, L)
            q = row[..., : d.inner].reshape(1, -1, d.n_heads, 1, d.head_dim)
            q = q.permute(0, 2, 3, 1, 4)  # [1, H, 1, n, D]
            k = _heads(row[..., d.inner : 2 * d.inner], d)  # [1, H, n, D]
            v = _heads(row[..., 2 * d.inner :], d)
            a = cached_attention(q, k, v, past_k, past_v, past_len, causal, bias)  # [1, H, 1, n, D]
            outs.append(a.squeeze(2).transpose(1, 2).reshape(1, -1, d.inner))
            new.append((k, v))
        x = x + F.linear(lanes_cat(outs), self.wo)
        h = rms_norm(x, self.cross_norm, d.norm_eps)
        q = F.linear(h, self.wq_cross)  # [L, n, H*D]
        outs = [_merge(_masked_attention(_heads(lane(q, b, L), d), cross_k, cross_v, src_ok), d)
                for b, (*_, cross_k, cross_v, src_ok) in enumerate(lanes)]
        x = x + F.linear(lanes_cat(outs), self.wo_cross)
        return x + self.ff(rms_norm(x, self.ff.norm, d.norm_eps)), new


class T5Decoder(CachedDecoder):
    """forward(input_ids, position, num_logits, *past, *cross, source_mask) -> (logits, *present),
    past/present/cross flattened as (key.0, value.0, key.1, ...); forward_lanes, the same for
    several sequences (common.py, lanes)."""

    model_type = "t5"

    def __init__(self, d: T5Dims, max_len: int, max_source_len: int):
        super().__init__()
        self.d = d
        self.n_layers, self.n_kv_heads, self.head_dim = d.n_dec_layers, d.n_heads, d.head_dim
        self.max_len, self.max_source_len, self.vocab_size = max_len, max_source_len, d.vocab_size
        self.layers = nn.ModuleList(DecoderBlock(d) for _ in range(d.n_dec_layers))

    def _bias(self, q_pos, past_len):
        # bias for the cache block (keys at slots 0..P-1) and the new block (keys at q_pos);
        # G = 1 (every head has its own K/V), so this is already cached_attention's folded layout
        return (self.rel_bias(q_pos, torch.arange(past_len)), self.rel_bias(q_pos, q_pos))

    def forward(self, input_ids, position, num_logits, *args):
        nl = self.n_layers
        past, cross, source_mask = args[: 2 * nl], args[2 * nl : 4 * nl], args[4 * nl]
        n = input_ids.shape[1]
        x = F.embedding(input_ids, self.embed)  # [1, n, C]
        q_pos = position + torch.arange(n)  # [n] absolute
        past_len, causal = step_masks(n, position, self.max_len)
        bias = self._bias(q_pos, past_len)
        src_ok = (source_mask != 0)[:, None, None, :]  # [1, 1, 1, S]
        present = []
        for i, layer in enumerate(self.layers):
            x, [(k, v)] = layer(x, causal, [(bias, past[2 * i], past[2 * i + 1], past_len,
                                             cross[2 * i], cross[2 * i + 1], src_ok)])
            present += [k, v]
        x = x[:, n - num_logits :]  # [1, num_logits, C]: lm_head only for the rows asked for
        return (self._head(x), *present)

    def _head(self, x):
        x = rms_norm(x, self.norm, self.d.norm_eps)
        if self.d.scale_output:
            x = x * (self.d.dim**-0.5)
        return F.linear(x, self.lm_head)

    def forward_lanes(self, lanes: int, input_ids, position, num_logits, row_ends, *args):
        """input_ids [L, n], position and row_ends [L], each lane's past, each lane's cross K/V
        (contract.lane_kv_names' order), source_mask [L, S] -> (logits [L, K, V], each lane's
        new slots in that order)."""
        nl = self.n_layers
        past, cross = args[: 2 * nl * lanes], args[2 * nl * lanes : 4 * nl * lanes]
        source_mask = args[4 * nl * lanes]
        n = input_ids.shape[1]
        x = F.embedding(input_ids, self.embed)  # [L, n, C]
        lengths = lane_lengths(position, lanes, self.max_len)
        causal = causal_mask(n)
        context = [(self._bias(position[b] + torch.arange(n), lengths[b]), lengths[b],
                    (lane(source_mask, b, lanes) != 0)[:, None, None, :]) for b in range(lanes)]
        present = []
        for i, layer in enumerate(self.layers):
            x, new = layer(x, causal, [(bias, *lane_kv(past, nl, lanes, i, b), past_len,
                                        *lane_kv(cross, nl, lanes, i, b), src_ok)
                                       for b, (bias, past_len, src_ok) in enumerate(context)])
            present += [t for kv in new for t in kv]
        return (self._head(lane_rows(x, row_ends, num_logits)), *present)


class T5(nn.Module):
    """The pair of export-friendly graphs for one T5ForConditionalGeneration."""

    model_type = "t5"

    def __init__(self, d: T5Dims, max_len: int, max_source_len: int):
        super().__init__()
        if max_source_len < 1:
            raise ValueError(f"max_source_len must be >= 1, got {max_source_len}")
        self.d = d
        self.max_len, self.max_source_len, self.vocab_size = max_len, max_source_len, d.vocab_size
        self.encoder = T5Encoder(d, max_source_len)
        self.decoder = T5Decoder(d, max_len, max_source_len)

    @classmethod
    def from_hf(cls, hf_model, max_len: int, max_source_len: int) -> "T5":
        m = cls(T5Dims.from_config(hf_model.config), max_len, max_source_len)
        m.load_hf_state_dict(hf_model.state_dict())
        # our bucket tables must be HF's; a mismatch means a T5 variant we do not model
        hf_bucket = getattr(type(hf_model.encoder.block[0].layer[0].SelfAttention),
                            "_relative_position_bucket", None)
        if hf_bucket is not None:
            for rb, bidirectional in ((m.encoder.rel_bias, True), (m.decoder.rel_bias, False)):
                rel = torch.arange(-(rb.span - 1), rb.span)
                theirs = hf_bucket(rel, bidirectional=bidirectional, num_buckets=m.d.num_buckets,
                                   max_distance=m.d.max_distance)
                if not torch.equal(theirs, rb.buckets):
                    raise UnsupportedModel("t5: relative position buckets differ from Hugging Face's")
        return m.eval()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        d = self.d
        # old checkpoints carry a cross-attention relative bias that T5 never uses (HF lists it
        # in _keys_to_ignore_on_load_unexpected)
        unused = "EncDecAttention.relative_attention_bias.weight"
        sd = {k: v for k, v in sd.items() if not k.endswith(unused)}
        w = WeightMap(sd, "t5")
        C, I, V = d.dim, d.inner, d.vocab_size
        embed = w.take("shared.weight", (V, C))
        for stack in ("encoder", "decoder"):
            # encoder/decoder.embed_tokens are tied to shared; a checkpoint may list them
            e = w.take_optional(f"{stack}.embed_tokens.weight", (V, C))
            if e is not None and not torch.equal(e, embed):
                raise UnsupportedModel(f"t5: {stack}.embed_tokens.weight differs from shared.weight")
        enc, dec = self.encoder, self.decoder
        enc.embed, dec.embed = param(embed), param(embed)

        def qkv(p: str) -> nn.Parameter:
            # HF nn.Linear weights are [out, in], what F.linear wants; q, k, v fused in one MatMul
            return param(torch.cat([w.take(f"{p}.{x}.weight", (I, C)) for x in "qkv"], 0))  # [3I, C]

        # relative bias lives in block 0 of each stack and is shared by all its layers
        rel = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        enc.rel_bias = RelativeBias(w.take("encoder." + rel, (d.num_buckets, d.n_heads)),
                                    self.max_source_len, True, d)
        dec.rel_bias = RelativeBias(w.take("decoder." + rel, (d.num_buckets, d.n_heads)),
                                    self.max_len, False, d)
        for i, layer in enumerate(enc.layers):
            p = f"encoder.block.{i}.layer."
            layer.attn_norm = param(w.take(p + "0.layer_norm.weight", (C,)))
            layer.wqkv = qkv(p + "0.SelfAttention")
            layer.wo = param(w.take(p + "0.SelfAttention.o.weight", (C, I)))
            layer.ff.load(w, p + "1.")
        enc.norm = param(w.take("encoder.final_layer_norm.weight", (C,)))
        cross_kv = []
        for i, layer in enumerate(dec.layers):
            p = f"decoder.block.{i}.layer."
            layer.self_norm = param(w.take(p + "0.layer_norm.weight", (C,)))
            layer.wqkv = qkv(p + "0.SelfAttention")
            layer.wo = param(w.take(p + "0.SelfAttention.o.weight", (C, I)))
            layer.cross_norm = param(w.take(p + "1.layer_norm.weight", (C,)))
            layer.wq_cross = param(w.take(p + "1.EncDecAttention.q.weight", (I, C)))
            # the cross K/V projections read only the encoder output: they run in the encoder graph
            cross_kv += [w.take(p + f"1.EncDecAttention.{x}.weight", (I, C)) for x in "kv"]
            layer.wo_cross = param(w.take(p + "1.EncDecAttention.o.weight", (C, I)))
            layer.ff.load(w, p + "2.")
        enc.w_cross_kv = param(torch.cat(cross_kv, 0))  # [2 * layers * I, C]: k.0, v.0, k.1, ...
        dec.norm = param(w.take("decoder.final_layer_norm.weight", (C,)))
        head = w.take("lm_head.weight", (V, C))
        # v1.0 ties lm_head to the embedding (stored once in the graph); flan-t5 has its own
        dec.lm_head = dec.embed if torch.equal(head, embed) else param(head)
        w.finish()
