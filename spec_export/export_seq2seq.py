"""Export an encoder-decoder (models.T5, models.Whisper) to two ONNX graphs that follow the
runtime's contract (spec_runtime/bundle/contract.py): an encoder graph (of source ids, or of a
log-mel window for speech), and a decoder graph that is the decoder-only one plus the cross
inputs, so the runtime drives it with the same engine code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_runtime.bundle.contract import FEATURES, DIM_N, decoder_io, encoder_io, kv_names

from .onnx_export import (check_contract, check_max_len, example_step, export_graph, io_names,
                          module_dims)


def expected_io(model) -> dict[str, tuple[list[dict], list[dict]]]:
    """{"encoder": (inputs, outputs), "decoder": (inputs, outputs)} as describe() prints them."""
    dec, S = model.decoder, model.max_source_len
    dims = module_dims(dec)
    audio = getattr(model, "audio", False)
    return {"encoder": encoder_io(dims, S, n_mels=model.n_mels if audio else None),
            "decoder": decoder_io(dims, dec.max_len, "new-slots", S, audio=audio)}


def export_seq2seq(model, encoder_path, decoder_path, max_len: int, opset: int = 17) -> dict[str, dict]:
    """Write model.encoder and model.decoder (float32); returns {"encoder": desc, "decoder": desc}
    with describe()'s fields, as onnx_export.export_decoder does for one graph."""
    dec, S = model.decoder, model.max_source_len
    check_max_len(dec, max_len)
    want = expected_io(model)
    nl = dec.n_layers
    if getattr(model, "audio", False):  # one whole window: nothing to mask
        features = torch.zeros(1, model.n_mels, 2 * S)
        enc_desc = export_graph(model.encoder, Path(encoder_path), (features,), [FEATURES],
                                kv_names("cross", nl), None, opset=opset)
        mask, mask_names = (), []
    else:
        # S is static, and a source of 3 real tokens keeps the mask from being constant-folded
        ids = torch.zeros(1, S, dtype=torch.int64)
        mask = (torch.arange(S) < min(3, S)).to(torch.int64)[None]
        enc_desc = export_graph(model.encoder, Path(encoder_path), (ids, mask),
                                ["input_ids", "attention_mask"], kv_names("cross", nl), None,
                                opset=opset)
        mask, mask_names = (mask,), ["source_mask"]
    check_contract(enc_desc, *want["encoder"])

    cross = [torch.zeros(1, dec.n_kv_heads, S, dec.head_dim) for _ in range(2 * nl)]
    args = (*example_step(dec), *cross, *mask)
    n = torch.export.Dim(DIM_N, min=1, max=max_len)
    # forward(input_ids, position, num_logits, *args): the varargs are one tuple to torch.export
    dynamic_shapes = ({1: n}, None, None, tuple({} for _ in range(4 * nl + len(mask))))
    in_names, out_names = io_names(nl)
    dec_desc = export_graph(dec, Path(decoder_path), args,
                            in_names + kv_names("cross", nl) + mask_names,
                            out_names, dynamic_shapes, opset=opset, logits_axis=True)
    check_contract(dec_desc, *want["decoder"])
    for d in (enc_desc, dec_desc):
        d.update(max_len=max_len, max_source_len=S)
    return {"encoder": enc_desc, "decoder": dec_desc}
