"""Parity of exported encoder and decoder graphs against a Hugging Face encoder-decoder LM.

The encoder graph runs once on the right-padded source; its cross K/V (real rows only: padded
rows are masked by every consumer) are compared with those Hugging Face caches. The decoder graph
is then driven exactly as the runtime drives it, through parity.drive_calls: a numpy
self-attention cache that starts as finite garbage, chunked prefill, single steps, a verify call,
a rollback over stale slots and a second verify; every call is compared with a fresh HF forward
of the whole decoder sequence.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .parity import NumpyCacheRunner, drive_calls, make_session


def pad_source(source_ids: list[int], max_source_len: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (input_ids, attention_mask) int64 [1, max_source_len], right-padded with id 0."""
    if not 1 <= len(source_ids) <= max_source_len:
        raise ValueError(f"source of {len(source_ids)} tokens does not fit max_source_len={max_source_len}")
    ids = np.zeros((1, max_source_len), dtype=np.int64)
    mask = np.zeros((1, max_source_len), dtype=np.int64)
    ids[0, : len(source_ids)] = source_ids
    mask[0, : len(source_ids)] = 1
    return ids, mask


def _hf_cross_kv(hf_model, src: torch.Tensor, start_id: int) -> list[np.ndarray]:
    """Cross-attention K/V per decoder layer as HF caches them: [key.0, value.0, key.1, ...]."""
    out = hf_model(input_ids=src, decoder_input_ids=torch.tensor([[start_id]]), use_cache=True)
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
    source_ids: list[int],
    decoder_ids: list[int],
    *,
    prefill_chunk: int = 3,
    steps: int = 3,
    verify_len: int = 5,
    seed: int = 0,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """-> {"encoder": max |cross K/V diff|, "decoder": max |logits diff|}. `decoder_ids` is the
    decoder prompt, starting with the decoder start token."""
    hf_model.eval()
    enc = make_session(encoder_path, threads)
    S = enc.get_inputs()[0].shape[1]
    ids, mask = pad_source(source_ids, S)
    names = [o.name for o in enc.get_outputs()]
    cross = dict(zip(names, enc.run(names, {"input_ids": ids, "attention_mask": mask})))
    src = torch.tensor([source_ids])
    n_src = len(source_ids)
    ref = _hf_cross_kv(hf_model, src, decoder_ids[0])
    if len(ref) != len(names):
        raise ValueError(f"encoder graph returns {len(names)} cross tensors, the model has {len(ref)}")
    enc_diff = max(float(np.abs(cross[nm][:, :, :n_src] - r).max()) for nm, r in zip(names, ref))
    if log:
        log(f"{'encode':>8} source={n_src:<4} max|cross diff|={enc_diff:.3g}")

    runner = NumpyCacheRunner(make_session(decoder_path, threads), np.random.default_rng(seed),
                              extra_feeds={**cross, "source_mask": mask})

    def reference(tokens: list[int], num_logits: int) -> np.ndarray:
        out = hf_model(input_ids=src, decoder_input_ids=torch.tensor([tokens]), use_cache=False)
        return out.logits[0, -num_logits:].float().numpy()

    dec_diff = drive_calls(runner, reference, decoder_ids, hf_model.config.vocab_size,
                           prefill_chunk=prefill_chunk, steps=steps, verify_len=verify_len,
                           rng=np.random.default_rng(seed + 1), log=log)
    return {"encoder": enc_diff, "decoder": dec_diff}
