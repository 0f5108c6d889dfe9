"""Parity of exported graphs against the Hugging Face model they came from: a decoder graph, or
an encoder-decoder's encoder and decoder graphs, through one entry point (check_parity) and
one signature.

For an encoder-decoder the encoder runs once on the right-padded source; its cross K/V (real
rows only: padded rows are masked by every consumer) are compared with those Hugging Face
caches. The decoder is then driven as the decode loop drives it, through calls.plan_calls and
run_calls: a self-attention cache that starts as finite garbage, chunked prefill, single steps,
a verify call, a rollback over stale slots and a second verify; every call is compared with a
fresh HF forward of the whole (decoder) sequence. An encoder-decoder's float32 graphs are held
to quality.fp32_tolerance of their values' scale and, where the model itself amplifies float32
rounding, of that rounding (fp32_parity_seq2seq).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import numpy as np
import torch

from .calls import (DAMAGED_WEIGHTS, GRAPH_NOT_FINITE, PREFILL_CHUNK, SEQ2SEQ_PREFILL_CHUNK, STEPS,
                    VERIFY_LEN, followed_tokens, hf_reference, open_decoder, plan_calls,
                    require_finite, run_calls)
from .quality import FOLLOW_TOKENS, fp32_tolerance


def _hf_cross_kv(hf_model, src: dict, start_id: int, dtype=torch.float32) -> list[np.ndarray]:
    """Cross-attention K/V per decoder layer as HF caches them: [key.0, value.0, key.1, ...]."""
    out = hf_model(**src, decoder_input_ids=torch.tensor([[start_id]]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values  # renamed in transformers 5
    cross = cache.cross_attention_cache
    if hasattr(cross, "layers"):  # transformers >= 4.56
        pairs = [(layer.keys, layer.values) for layer in cross.layers]
    else:
        pairs = list(zip(cross.key_cache, cross.value_cache))
    return [t.to(dtype).numpy() for kv in pairs for t in kv]


@torch.no_grad()
def check_parity(hf_model, decoder_path, decoder_ids: list[int], **options) -> dict[str, float]:
    """-> {"decoder": max |logits diff|}, and for an encoder-decoder (`encoder_path` and
    `source` in `options`) first "encoder": max |cross K/V diff|. `decoder_ids` is the
    (decoder) prompt: an encoder-decoder's starts with the decoder start token; `source` is the
    source's ids, or a speech model's features [n_mels, frames]. `options` are Run's
    (encoder_path, source, prefill_chunk, steps, verify_len, seed, threads, log, name). Values
    that are not finite are refused (`name` names the model)."""
    return Run(hf_model, decoder_path, decoder_ids, **options).diffs


@torch.no_grad()
def fp32_parity_seq2seq(hf_model, decoder_path, decoder_ids: list[int],
                        **options) -> dict[str, tuple[float, float]]:
    """{graph: (max |diff|, tolerance)} of an encoder-decoder's float32 graphs, as check_parity
    measures them (the same signature; `encoder_path` and `source` are needed). The tolerance is
    quality.fp32_tolerance of PyTorch's values' scale (the decoder-only rule: encoder and
    decoder values are as large as the model makes them); only where a graph is outside that is
    PyTorch's own float32 rounding of the same values measured against float64 and allowed for
    (FP32_ROUNDING_FACTOR), up to FP32_MAX_RELATIVE of the scale."""
    run = Run(hf_model, decoder_path, decoder_ids, **options)
    limits = {g: fp32_tolerance(run.scales[g]) for g in run.diffs}
    if any(not run.diffs[g] <= limits[g] for g in run.diffs):
        rounding = run.float32_rounding()
        limits = {g: fp32_tolerance(run.scales[g], rounding[g]) for g in run.diffs}
        if options.get("log"):
            options["log"]("PyTorch's float32 rounding (vs float64): " + ", ".join(
                f"{g} {rounding[g]:.3g}, tolerance {limits[g]:.3g}" for g in limits))
    return {g: (run.diffs[g], limits[g]) for g in run.diffs}


class Run:
    """One parity run: for an encoder-decoder the encoder once, then the decoder driven through
    calls.plan_calls. Keeps PyTorch's inputs and rows, so that an encoder-decoder's float32
    rounding can be measured on the same values afterwards (float32_rounding)."""

    @torch.no_grad()
    def __init__(self, hf_model, decoder_path, decoder_ids: list[int], *, encoder_path=None,
                 source=None, prefill_chunk: int | None = None, steps: int = STEPS,
                 verify_len: int = VERIFY_LEN, seed: int = 0, threads: int | None = None,
                 log: Callable[[str], None] | None = None, name: str = "the model"):
        if (encoder_path is None) != (source is None):
            raise ValueError("an encoder graph is checked on a source: give both or neither")
        hf_model.eval()
        self.hf_model = hf_model
        self.src = None  # an encoder-decoder's Hugging Face inputs for `source`
        self.diffs, self.scales = {}, {}
        engine = open_decoder(decoder_path, threads, seed, encoder_path=encoder_path)
        if encoder_path is not None:
            self._encode(engine, source, decoder_ids[0], log, name)
        if prefill_chunk is None:
            prefill_chunk = PREFILL_CHUNK if encoder_path is None else SEQ2SEQ_PREFILL_CHUNK
        self.calls = plan_calls(hf_reference(hf_model, self.src), decoder_ids,
                                hf_model.config.vocab_size, engine.max_len,
                                prefill_chunk=prefill_chunk, steps=steps, verify_len=verify_len,
                                rng=np.random.default_rng(seed + 1), name=name)
        self.diffs["decoder"] = run_calls(engine, self.calls, log, name)
        self.scales["decoder"] = max(float(np.abs(c.want).max()) for c in self.calls)

    def _encode(self, engine, source, start_id: int, log, name: str) -> None:
        """The encoder graph's cross K/V for `source` against Hugging Face's."""
        engine.encode_source(source)
        self.src, n_src = _source_inputs(engine, source)
        self.start_id = start_id
        self.cross = _hf_cross_kv(self.hf_model, self.src, start_id)
        names = engine.cross_names
        if len(self.cross) != len(names):
            raise ValueError(f"encoder graph returns {len(names)} cross tensors, the model has "
                             f"{len(self.cross)}")
        got = [engine.cross[nm].numpy()[:, :, :n_src] for nm in names]
        for r, g in zip(self.cross, got):
            require_finite(r, f"{name}: the PyTorch model's cross-attention keys and values",
                           DAMAGED_WEIGHTS)
            require_finite(g, f"{name}: the exported encoder's cross-attention keys and values",
                           GRAPH_NOT_FINITE)
        self.diffs["encoder"] = max(float(np.abs(g - r).max()) for g, r in zip(got, self.cross))
        self.scales["encoder"] = max(float(np.abs(r).max()) for r in self.cross)
        if log:
            log(f"{'encode':>8} source={n_src:<4} max|cross diff|={self.diffs['encoder']:.3g}")

    @torch.no_grad()
    def float32_rounding(self) -> dict[str, float]:
        """{graph: max |PyTorch's float32 values - its float64 values|} over an encoder-decoder
        run's values: how far float32 rounding alone moves them in this model."""
        src = {k: v.double() if v.is_floating_point() else v for k, v in self.src.items()}
        with _float64(self.hf_model):
            cross = _hf_cross_kv(self.hf_model, src, self.start_id, torch.float64)
            reference = hf_reference(self.hf_model, src, torch.float64)
            tokens: list[int] = []
            decoder = 0.0
            for c in self.calls:  # the sequence each call's rows are for, as plan_calls built it
                del tokens[c.position:]
                tokens.extend(c.ids)
                rows = reference(tokens, c.num_logits)
                decoder = max(decoder, float(np.abs(c.want - rows).max()))
        encoder = max(float(np.abs(r - r64).max()) for r, r64 in zip(self.cross, cross))
        return {"encoder": encoder, "decoder": decoder}


@torch.no_grad()
def follows_float(hf_model, decoder_path, prompt: list[int], *, encoder_path, source,
                  n: int = FOLLOW_TOKENS, threads: int | None = None) -> tuple[int, int]:
    """(how many tokens the graphs' greedy decoding of `prompt` over `source` agrees with the
    float PyTorch model's greedy continuation before they first differ, that continuation's
    length): calls.followed_tokens for an encoder-decoder. The continuation is `n` tokens, or
    what the cache holds; the end of text does not stop it."""
    hf_model.eval()
    engine = open_decoder(decoder_path, threads, 0, encoder_path=encoder_path)
    engine.encode_source(source)
    src, _ = _source_inputs(engine, source)
    encoded = hf_model.get_encoder()(**src)
    tokens = list(prompt)
    for _ in range(min(n, engine.max_len - len(prompt))):
        logits = hf_model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([tokens]),
                          use_cache=False).logits[0, -1]
        tokens.append(int(logits.argmax()))
    continuation = tokens[len(prompt):]
    return followed_tokens(engine, [(list(prompt), continuation)])[0], len(continuation)


def _source_inputs(engine, source) -> tuple[dict, int]:
    """(the Hugging Face model's inputs for `source`, its real length in encoder positions)."""
    if engine.audio:  # the whole window is real
        return ({"input_features": torch.tensor(np.asarray(source, np.float32))[None]},
                engine.max_source_len)
    return {"input_ids": torch.tensor([list(source)])}, len(source)


@contextmanager
def _float64(model):
    """`model` in float64 in place, then each tensor back in its own dtype: exact both ways
    (float64 holds every float32 and bfloat16 value), and no second copy of the weights."""
    dtypes = [t.dtype for t in (*model.parameters(), *model.buffers())]
    model.double()
    try:
        yield model
    finally:
        for t, dtype in zip((*model.parameters(), *model.buffers()), dtypes):
            t.data = t.data.to(dtype)
