"""Export an encoder-decoder (models.T5) to two ONNX graphs that follow the runtime's contract.

    encoder  inputs   input_ids int64 [1, S] · attention_mask int64 [1, S]     (S static: the
                      source is right-padded to max_source_len, padding masked)
             outputs  cross_key.{i} / cross_value.{i} float32 [1, heads, S, head_dim]
    decoder  inputs   input_ids int64 [1, n] · position int64 [] · num_logits int64 []
                      past_key.{i} / past_value.{i} float32 [1, heads, max_len, head_dim]
                      cross_key.{i} / cross_value.{i} float32 [1, heads, S, head_dim]
                      source_mask int64 [1, S]
             outputs  logits float32 [1, num_logits, vocab]
                      present_key.{i} / present_value.{i} float32 [1, heads, n, head_dim]

i runs over the decoder layers. The decoder is the decoder-only contract plus the cross inputs,
so the runtime drives it with the same engine code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .onnx_export import (DIM_N, DIM_NUM_LOGITS, check_contract, check_max_len, example_step,
                          export_graph, io_names)


def cross_names(n_layers: int) -> list[str]:
    return [f"cross_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]


def expected_io(model) -> dict[str, tuple[list[dict], list[dict]]]:
    """{"encoder": (inputs, outputs), "decoder": (inputs, outputs)} as describe() prints them."""
    dec = model.decoder
    S, nl = model.max_source_len, dec.n_layers
    cross = [1, dec.n_kv_heads, S, dec.head_dim]
    f32 = lambda names, shape: [{"name": nm, "dtype": "float32", "shape": shape} for nm in names]
    ids = lambda name, shape: {"name": name, "dtype": "int64", "shape": shape}
    enc_io = ([ids("input_ids", [1, S]), ids("attention_mask", [1, S])], f32(cross_names(nl), cross))
    in_names, out_names = io_names(nl)
    dec_ins = [ids("input_ids", [1, DIM_N]), ids("position", []), ids("num_logits", [])]
    dec_ins += f32(in_names[3:], list(dec.cache_shape())) + f32(cross_names(nl), cross)
    dec_ins += [ids("source_mask", [1, S])]
    dec_outs = [{"name": "logits", "dtype": "float32", "shape": [1, DIM_NUM_LOGITS, dec.vocab_size]}]
    dec_outs += f32(out_names[1:], [1, dec.n_kv_heads, DIM_N, dec.head_dim])
    return {"encoder": enc_io, "decoder": (dec_ins, dec_outs)}


def export_seq2seq(model, encoder_path, decoder_path, max_len: int, opset: int = 17) -> dict[str, dict]:
    """Write model.encoder and model.decoder (float32); returns {"encoder": desc, "decoder": desc}
    with describe()'s fields, as onnx_export.export_decoder does for one graph."""
    dec, S = model.decoder, model.max_source_len
    check_max_len(dec, max_len)
    want = expected_io(model)
    nl = dec.n_layers
    # S is static, and a source of 3 real tokens keeps the mask from being constant-folded
    ids = torch.zeros(1, S, dtype=torch.int64)
    mask = (torch.arange(S) < min(3, S)).to(torch.int64)[None]
    enc_desc = export_graph(model.encoder, Path(encoder_path), (ids, mask), ["input_ids", "attention_mask"],
                            cross_names(nl), None, opset=opset)
    check_contract(enc_desc, *want["encoder"])

    cross = [torch.zeros(1, dec.n_kv_heads, S, dec.head_dim) for _ in range(2 * nl)]
    args = (*example_step(dec), *cross, mask)
    n = torch.export.Dim(DIM_N, min=1, max=max_len)
    # forward(input_ids, position, num_logits, *args): the varargs are one tuple to torch.export
    dynamic_shapes = ({1: n}, None, None, tuple({} for _ in range(4 * nl + 1)))
    in_names, out_names = io_names(nl)
    dec_desc = export_graph(dec, Path(decoder_path), args, in_names + cross_names(nl) + ["source_mask"],
                            out_names, dynamic_shapes, opset=opset, logits_axis=True)
    check_contract(dec_desc, *want["decoder"])
    for d in (enc_desc, dec_desc):
        d.update(max_len=max_len, max_source_len=S)
    return {"encoder": enc_desc, "decoder": dec_desc}
