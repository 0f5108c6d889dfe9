"""Parity of exported encoder and decoder graphs against a Hugging Face encoder-decoder LM.

Both graphs run through the runtime's own engine (spec_runtime.engines.opener.open_graph). The
encoder runs once on the right-padded source; its cross K/V (real rows only: padded rows are
masked by every consumer) are compared with those Hugging Face caches. The decoder is then
driven as the decode loop drives it, through parity.drive_calls: a self-attention cache that
starts as finite garbage, chunked prefill, single steps, a verify call, a rollback over stale
slots and a second verify; every call is compared with a fresh HF forward of the whole decoder
sequence.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from spec_runtime.engines.opener import open_graph

from .parity import (DAMAGED_WEIGHTS, GRAPH_NOT_FINITE, drive_calls, graph_dims, graph_entry,
                     require_finite)


def _hf_cross_kv(hf_model, src: dict, start_id: int) -> list[np.ndarray]:
    """Cross-attention K/V per decoder layer as HF caches them: [key.0, value.0, key.1, ...]."""
    out = hf_model(**src, decoder_input_ids=torch.tensor([[start_id]]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values  # renamed in transformers 5
    cross = cache.cross_attention_cache
    if hasattr(cross, "layers"):  # transformers >= 4.56
        pairs = [(layer.keys, layer.values) for layer in cross.layers]
    else:
        pairs = list(zip(cross.key_cache, cross.value_cache))
    return [t.float().numpy() for kv in pairs for t in kv]


@torch.no_grad()
def check_parity_seq2seq(
    hf_model,
    encoder_path,
    decoder_path,
    source,
    decoder_ids: list[int],
    *,
    prefill_chunk: int = 3,
    steps: int = 3,
    verify_len: int = 5,
    seed: int = 0,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
    name: str = "the model",
) -> dict[str, float]:
    """-> {"encoder": max |cross K/V diff|, "decoder": max |logits diff|}. `source` is the
    source's ids, or a speech model's features [n_mels, frames]; `decoder_ids` is the decoder
    prompt, starting with the decoder start token. Values that are not finite are
    refused (`name` names the model)."""
    hf_model.eval()
    decoder, encoder = graph_entry(decoder_path), graph_entry(encoder_path)
    max_len, vocab = graph_dims(decoder)
    first = encoder.inputs[0]["shape"]
    # the encoder's output length: a token source is [1, max_source_len]; a speech window is
    # [1, n_mels, frames], which the encoder's stride-2 convolution halves
    S = first[2] // 2 if len(first) == 3 else first[1]
    engine = open_graph(decoder_path, decoder, encoder=(encoder_path, encoder), vocab_size=vocab,
                        max_len=max_len, max_source_len=S, prefill_chunk=max_len,
                        threads=threads, where="exported", garbage_seed=seed)
    engine.encode_source(source)
    if engine.audio:  # the whole window is real
        src, n_src = {"input_features": torch.tensor(np.asarray(source, np.float32))[None]}, S
    else:
        src, n_src = {"input_ids": torch.tensor([list(source)])}, len(source)
    ref = _hf_cross_kv(hf_model, src, decoder_ids[0])
    names = engine.cross_names
    if len(ref) != len(names):
        raise ValueError(f"encoder graph returns {len(names)} cross tensors, the model has {len(ref)}")
    got = [engine.cross[nm].numpy()[:, :, :n_src] for nm in names]
    for r, g in zip(ref, got):
        require_finite(r, f"{name}: the PyTorch model's cross-attention keys and values",
                       DAMAGED_WEIGHTS)
        require_finite(g, f"{name}: the exported encoder's cross-attention keys and values",
                       GRAPH_NOT_FINITE)
    enc_diff = max(float(np.abs(g - r).max()) for g, r in zip(got, ref))
    if log:
        log(f"{'encode':>8} source={n_src:<4} max|cross diff|={enc_diff:.3g}")

    def reference(tokens: list[int], num_logits: int) -> np.ndarray:
        out = hf_model(**src, decoder_input_ids=torch.tensor([tokens]), use_cache=False)
        return out.logits[0, -num_logits:].float().numpy()

    dec_diff = drive_calls(engine, reference, decoder_ids, hf_model.config.vocab_size,
                           prefill_chunk=prefill_chunk, steps=steps, verify_len=verify_len,
                           rng=np.random.default_rng(seed + 1), log=log, name=name)
    return {"encoder": enc_diff, "decoder": dec_diff}
