"""Export an encoder-decoder (models.T5, models.Whisper) to two ONNX graphs that follow the
runtime's contract (spec_runtime/bundle/contract.py): an encoder graph (of source ids, or of a
log-mel window for speech), and a decoder graph that is the decoder-only one plus the cross
inputs, so the runtime drives it with the same engine code; and, for `specexport build
--max-batch L`, the decoder's lanes graph (`export_decoder_lanes`): L sequences in one call,
each lane with its own caches, cross K/V and source mask.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_runtime.bundle.contract import (FEATURES, DIM_N, ROW_ENDS, decoder_io, decoder_lanes_io,
                                          encoder_io, kv_names, lane_kv_names)

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


class _Lanes(torch.nn.Module):
    """The decoder's forward_lanes at `lanes` lanes, as the module torch.export exports."""

    def __init__(self, decoder, lanes: int):
        super().__init__()
        self.decoder, self.lanes = decoder, lanes

    def forward(self, input_ids, position, num_logits, row_ends, *args):
        return self.decoder.forward_lanes(self.lanes, input_ids, position, num_logits, row_ends,
                                          *args)


def export_decoder_lanes(model, path, max_len: int, lanes: int, opset: int = 17) -> dict:
    """Write model.decoder's lanes graph (contract.decoder_lanes_io, new slots, float32) at
    `path`; returns describe() of it, as export_seq2seq does for its graphs."""
    dec, S = model.decoder, model.max_source_len
    check_max_len(dec, max_len)
    audio = getattr(model, "audio", False)
    nl = dec.n_layers
    # positions, row ends and source lengths distinct and > 1: no value specialised into the graph
    ids = torch.zeros(lanes, 3, dtype=torch.int64)
    position = torch.arange(lanes, dtype=torch.int64) + 4
    row_ends = torch.full((lanes,), 3, dtype=torch.int64)
    past = [torch.zeros(dec.cache_shape()) for _ in range(2 * nl * lanes)]
    cross = [torch.zeros(1, dec.n_kv_heads, S, dec.head_dim) for _ in range(2 * nl * lanes)]
    mask = () if audio else \
        ((torch.arange(S)[None] < (torch.arange(lanes)[:, None] % S + min(3, S))).to(torch.int64),)
    args = (ids, position, torch.tensor(2), row_ends, *past, *cross, *mask)
    n = torch.export.Dim(DIM_N, min=1, max=max_len)
    dynamic_shapes = ({1: n}, None, None, None, tuple({} for _ in range(len(args) - 4)))
    in_names = ["input_ids", "position", "num_logits", ROW_ENDS,
                *lane_kv_names("past", nl, lanes), *lane_kv_names("cross", nl, lanes),
                *([] if audio else ["source_mask"])]
    desc = export_graph(_Lanes(dec, lanes), Path(path), args, in_names,
                        ["logits", *lane_kv_names("present", nl, lanes)], dynamic_shapes,
                        opset=opset, logits_axis=True)
    check_contract(desc, *decoder_lanes_io(module_dims(dec), dec.max_len, lanes,
                                           kv_cache="new-slots", max_source_len=S, audio=audio))
    desc.update(max_len=max_len, max_source_len=S)
    return desc
