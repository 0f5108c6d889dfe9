"""Export-friendly Whisper over Hugging Face `WhisperForConditionalGeneration` weights, as two
graphs, the way models/t5.py splits T5:

    encoder   input_features float32 [1, n_mels, 2 * max_source_positions] (the log-mel window:
              spec_runtime/audio.py) -> cross_key.{i} / cross_value.{i} [1, H, S, D] for every
              DECODER layer i (S = max_source_positions: 1500 for 30 s)
    decoder   the decoder-only contract of models/common.py plus cross_key/value.{i}: the
              cross-attention K/V are computed once per request, in the encoder graph, and read
              by every decoder call from the static cache beside the self-attention's.

Whisper is a pre-LayerNorm transformer: a two-convolution front end (kernel 3, the second of
stride 2) with GELU, learned absolute positions (sinusoidal values stored as weights in the
encoder, trained ones in the decoder), attention whose query is scaled by head_dim**-0.5 before
the product (Hugging Face's order, which the original keeps), k_proj without a bias, GELU
feed-forward blocks, and the lm_head tied to the token embedding. The source is never masked:
the window is always whole (30 s, silence-padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import (CachedDecoder, UnsupportedModel, WeightMap, cached_attention, causal_mask,
                     lane, lane_kv, lane_lengths, lane_rows, lanes_cat, param, step_masks)


@dataclass(frozen=True)
class WhisperDims:
    vocab_size: int
    dim: int  # d_model
    n_heads: int  # the same in encoder and decoder (checked)
    ffn_dim: int
    n_enc_layers: int
    n_dec_layers: int
    n_mels: int
    max_source_positions: int
    max_target_positions: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_config(cls, c) -> "WhisperDims":
        if c.encoder_attention_heads != c.decoder_attention_heads:
            raise UnsupportedModel("whisper: encoder and decoder head counts differ "
                                   f"({c.encoder_attention_heads} vs {c.decoder_attention_heads})")
        if c.encoder_ffn_dim != c.decoder_ffn_dim:
            raise UnsupportedModel("whisper: encoder and decoder feed-forward widths differ")
        if getattr(c, "activation_function", "gelu") != "gelu":
            raise UnsupportedModel(f"whisper: activation {c.activation_function!r} is not "
                                   "supported (gelu is)")
        if c.d_model % c.encoder_attention_heads:
            raise UnsupportedModel("whisper: d_model is not a multiple of the head count")
        return cls(vocab_size=c.vocab_size, dim=c.d_model, n_heads=c.encoder_attention_heads,
                   ffn_dim=c.encoder_ffn_dim, n_enc_layers=c.encoder_layers,
                   n_dec_layers=c.decoder_layers, n_mels=c.num_mel_bins,
                   max_source_positions=c.max_source_positions,
                   max_target_positions=c.max_target_positions)


def _heads(x: torch.Tensor, d: WhisperDims) -> torch.Tensor:
    return x.reshape(1, -1, d.n_heads, d.head_dim).transpose(1, 2)  # [1, n, C] -> [1, H, n, D]


def _merge(x: torch.Tensor, d: WhisperDims) -> torch.Tensor:
    return x.transpose(1, 2).reshape(1, -1, d.dim)  # [1, H, n, D] -> [1, n, C]


def _norm(x, p: tuple) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), p[0], p[1], 1e-5)


class FeedForward(nn.Module):
    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


class EncoderBlock(nn.Module):
    def __init__(self, d: WhisperDims):
        super().__init__()
        self.d = d
        self.ff = FeedForward()

    def forward(self, x):
        d = self.d
        h = _norm(x, self.attn_norm)
        qkv = F.linear(h, self.wqkv, self.bqkv)  # [1, S, 3C]
        q = _heads(qkv[..., : d.dim] * d.head_dim**-0.5, d)
        k, v = _heads(qkv[..., d.dim : 2 * d.dim], d), _heads(qkv[..., 2 * d.dim :], d)
        a = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        x = x + F.linear(_merge(a, d), self.wo, self.bo)
        return x + self.ff(_norm(x, self.ff_norm))


class WhisperEncoder(nn.Module):
    """input_features [1, n_mels, 2S] -> (cross_key.0, cross_value.0, ...) [1, H, S, D]: the
    decoder's cross-attention K and V projections of every layer run here, in one MatMul over
    the encoder output, so a decoder step never recomputes them."""

    def __init__(self, d: WhisperDims):
        super().__init__()
        self.d = d
        self.n_layers, self.n_heads, self.head_dim = d.n_dec_layers, d.n_heads, d.head_dim
        self.layers = nn.ModuleList(EncoderBlock(d) for _ in range(d.n_enc_layers))

    def forward(self, input_features):
        d = self.d
        x = F.gelu(F.conv1d(input_features, self.conv1_w, self.conv1_b, padding=1))
        x = F.gelu(F.conv1d(x, self.conv2_w, self.conv2_b, stride=2, padding=1))
        x = x.permute(0, 2, 1) + self.positions  # [1, S, C]
        for layer in self.layers:
            x = layer(x)
        h = _norm(x, self.norm)
        kv = F.linear(h, self.w_cross_kv, self.b_cross_kv)  # [1, S, 2 * layers * C]
        return tuple(_heads(kv[..., j * d.dim : (j + 1) * d.dim], d)
                     for j in range(2 * d.n_dec_layers))


class DecoderBlock(nn.Module):
    def __init__(self, d: WhisperDims):
        super().__init__()
        self.d = d
        self.ff = FeedForward()

    def forward(self, x, causal, lanes: list):
        """x [L, n, C]; `lanes`: one (past_k, past_v, past_len, cross_k, cross_v) per lane
        (common.py, lanes) -> (x, [(k, v) of each lane's new slots])."""
        d, L = self.d, len(lanes)
        h = _norm(x, self.self_norm)
        qkv = F.linear(h, self.wqkv, self.bqkv)  # [L, n, 3C]
        outs, new = [], []
        for b, (past_k, past_v, past_len, _, _) in enumerate(lanes):
            row = lane(qkv, b, L)  # [1, n, 3C]
            q = (row[..., : d.dim] * d.head_dim**-0.5).reshape(1, -1, d.n_heads, 1, d.head_dim)
            q = q.permute(0, 2, 3, 1, 4)  # [1, H, 1, n, D]
            k, v = _heads(row[..., d.dim : 2 * d.dim], d), _heads(row[..., 2 * d.dim :], d)
            a = cached_attention(q, k, v, past_k, past_v, past_len, causal)  # [1, H, 1, n, D]
            outs.append(a.squeeze(2).transpose(1, 2).reshape(1, -1, d.dim))
            new.append((k, v))
        x = x + F.linear(lanes_cat(outs), self.wo, self.bo)
        h = _norm(x, self.cross_norm)
        q = F.linear(h, self.wq_cross, self.bq_cross) * d.head_dim**-0.5
        outs = []
        for b, (_, _, _, cross_k, cross_v) in enumerate(lanes):
            qb = _heads(lane(q, b, L), d)
            outs.append(_merge(torch.softmax(qb @ cross_k.transpose(-1, -2), dim=-1) @ cross_v,
                               d))
        x = x + F.linear(lanes_cat(outs), self.wo_cross, self.bo_cross)
        return x + self.ff(_norm(x, self.ff_norm)), new


class WhisperDecoder(CachedDecoder):
    """forward(input_ids, position, num_logits, *past, *cross) -> (logits, *present), past,
    present and cross flattened as (key.0, value.0, key.1, ...); forward_lanes, the same for
    several sequences (common.py, lanes)."""

    model_type = "whisper"

    def __init__(self, d: WhisperDims, max_len: int):
        super().__init__()
        if max_len > d.max_target_positions:
            raise UnsupportedModel(f"whisper: max_len {max_len} exceeds the model's "
                                   f"{d.max_target_positions} learned positions")
        self.d = d
        self.n_layers, self.n_kv_heads, self.head_dim = d.n_dec_layers, d.n_heads, d.head_dim
        self.max_len, self.vocab_size = max_len, d.vocab_size
        self.layers = nn.ModuleList(DecoderBlock(d) for _ in range(d.n_dec_layers))

    def forward(self, input_ids, position, num_logits, *args):
        nl = self.n_layers
        past, cross = args[: 2 * nl], args[2 * nl : 4 * nl]
        n = input_ids.shape[1]
        q_pos = position + torch.arange(n)  # [n] absolute
        x = F.embedding(input_ids, self.embed) + F.embedding(q_pos, self.positions)[None]
        past_len, causal = step_masks(n, position, self.max_len)
        present = []
        for i, layer in enumerate(self.layers):
            x, [(k, v)] = layer(x, causal, [(past[2 * i], past[2 * i + 1], past_len,
                                             cross[2 * i], cross[2 * i + 1])])
            present += [k, v]
        x = _norm(x[:, n - num_logits :], self.norm)  # lm_head only for the rows asked for
        return (F.linear(x, self.lm_head), *present)

    def forward_lanes(self, lanes: int, input_ids, position, num_logits, row_ends, *args):
        """input_ids [L, n], position and row_ends [L], then each lane's past, then each
        lane's cross K/V (contract.lane_kv_names' order) -> (logits [L, K, V], each lane's
        new slots in that order)."""
        nl = self.n_layers
        past, cross = args[: 2 * nl * lanes], args[2 * nl * lanes : 4 * nl * lanes]
        n = input_ids.shape[1]
        q_pos = position[:, None] + torch.arange(n)  # [L, n] absolute
        x = F.embedding(input_ids, self.embed) + F.embedding(q_pos, self.positions)
        lengths = lane_lengths(position, lanes, self.max_len)
        causal = causal_mask(n)
        present = []
        for i, layer in enumerate(self.layers):
            x, new = layer(x, causal, [(*lane_kv(past, nl, lanes, i, b), lengths[b],
                                        *lane_kv(cross, nl, lanes, i, b))
                                       for b in range(lanes)])
            present += [t for kv in new for t in kv]
        x = _norm(lane_rows(x, row_ends, num_logits), self.norm)
        return (F.linear(x, self.lm_head), *present)


class Whisper(nn.Module):
    """The pair of export-friendly graphs for one WhisperForConditionalGeneration."""

    model_type = "whisper"
    audio = True  # the encoder reads log-mel features, not token ids

    def __init__(self, d: WhisperDims, max_len: int):
        super().__init__()
        self.d = d
        self.max_len, self.vocab_size = max_len, d.vocab_size
        self.max_source_len = d.max_source_positions
        self.n_mels = d.n_mels
        self.encoder = WhisperEncoder(d)
        self.decoder = WhisperDecoder(d, max_len)

    @classmethod
    def from_hf(cls, hf_model, max_len: int, max_source_len: int | None = None) -> "Whisper":
        """`max_source_len` is T5's option; Whisper's source is always its whole window (its
        max_source_positions), and the argument is ignored."""
        m = cls(WhisperDims.from_config(hf_model.config), max_len)
        m.load_hf_state_dict(hf_model.state_dict())
        return m.eval()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        d = self.d
        w = WeightMap(sd, "whisper")
        C, F_, V = d.dim, d.ffn_dim, d.vocab_size
        enc, dec = self.encoder, self.decoder

        def norm(p: str) -> tuple:
            return (param(w.take(p + ".weight", (C,))), param(w.take(p + ".bias", (C,))))

        def attention(layer, p: str, q_name="wqkv", o_name="wo") -> None:
            # q, k, v fused in one MatMul; k_proj has no bias in Whisper: zeros stand in
            ws = [w.take(f"{p}.{x}_proj.weight", (C, C)) for x in "qkv"]
            bq, bv = w.take(f"{p}.q_proj.bias", (C,)), w.take(f"{p}.v_proj.bias", (C,))
            setattr(layer, q_name, param(torch.cat(ws, 0)))
            setattr(layer, "b" + q_name[1:], param(torch.cat([bq, torch.zeros(C), bv])))
            setattr(layer, o_name, param(w.take(f"{p}.out_proj.weight", (C, C))))
            setattr(layer, "b" + o_name[1:], param(w.take(f"{p}.out_proj.bias", (C,))))

        def ffn(ff, p: str) -> None:
            ff.w1 = param(w.take(p + ".fc1.weight", (F_, C)))
            ff.b1 = param(w.take(p + ".fc1.bias", (F_,)))
            ff.w2 = param(w.take(p + ".fc2.weight", (C, F_)))
            ff.b2 = param(w.take(p + ".fc2.bias", (C,)))

        e = "model.encoder."
        enc.conv1_w = param(w.take(e + "conv1.weight", (C, d.n_mels, 3)))
        enc.conv1_b = param(w.take(e + "conv1.bias", (C,)))
        enc.conv2_w = param(w.take(e + "conv2.weight", (C, C, 3)))
        enc.conv2_b = param(w.take(e + "conv2.bias", (C,)))
        enc.positions = param(w.take(e + "embed_positions.weight", (d.max_source_positions, C)))
        for i, layer in enumerate(enc.layers):
            p = f"{e}layers.{i}."
            layer.attn_norm = norm(p + "self_attn_layer_norm")
            attention(layer, p + "self_attn")
            layer.ff_norm = norm(p + "final_layer_norm")
            ffn(layer.ff, p[:-1])
        enc.norm = norm(e + "layer_norm")
        dd = "model.decoder."
        embed = w.take(dd + "embed_tokens.weight", (V, C))
        dec.embed = param(embed)
        dec.positions = param(w.take(dd + "embed_positions.weight", (d.max_target_positions, C)))
        cross_w, cross_b = [], []
        for i, layer in enumerate(dec.layers):
            p = f"{dd}layers.{i}."
            layer.self_norm = norm(p + "self_attn_layer_norm")
            attention(layer, p + "self_attn")
            layer.cross_norm = norm(p + "encoder_attn_layer_norm")
            x = p + "encoder_attn"
            layer.wq_cross = param(w.take(x + ".q_proj.weight", (C, C)))
            layer.bq_cross = param(w.take(x + ".q_proj.bias", (C,)))
            # the cross K/V projections read only the encoder output: they run in its graph
            cross_w += [w.take(x + ".k_proj.weight", (C, C)), w.take(x + ".v_proj.weight", (C, C))]
            cross_b += [torch.zeros(C), w.take(x + ".v_proj.bias", (C,))]
            layer.wo_cross = param(w.take(x + ".out_proj.weight", (C, C)))
            layer.bo_cross = param(w.take(x + ".out_proj.bias", (C,)))
            layer.ff_norm = norm(p + "final_layer_norm")
            ffn(layer.ff, p[:-1])
        enc.w_cross_kv = param(torch.cat(cross_w, 0))  # [2 * layers * C, C]: k.0, v.0, k.1 ...
        enc.b_cross_kv = param(torch.cat(cross_b, 0))
        dec.norm = norm(dd + "layer_norm")
        head = w.take_optional("proj_out.weight", (V, C))
        if head is not None and not torch.equal(head, embed):
            raise UnsupportedModel("whisper: proj_out.weight differs from the token embedding")
        dec.lm_head = dec.embed
        w.finish()
