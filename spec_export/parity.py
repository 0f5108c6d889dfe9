"""Parity of an exported decoder graph against the Hugging Face PyTorch model.

The graph is driven the way the runtime drives it: a numpy KV cache at full capacity, `present`
written at [position, position + n), rollback by moving the position (rejected slots keep their
stale K/V and must be masked), logits only for the last `num_logits` rows. The cache starts as
finite garbage, not zeros, so a masking bug cannot hide behind zero-valued slots.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnxruntime as ort
import torch



def make_session(onnx_path, threads: int | None = None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])


class NumpyCacheRunner:
    """Runs a contract graph with the KV cache held in numpy, exactly like the runtime."""

    def __init__(self, session: ort.InferenceSession, rng: np.random.Generator | None = None,
                 extra_feeds: dict[str, np.ndarray] | None = None):
        self.session = session
        self.extra_feeds = dict(extra_feeds or {})  # per-request inputs (cross K/V, source_mask)
        pasts = [i for i in session.get_inputs() if i.name.startswith("past_")]
        self.kv_shape = tuple(pasts[0].shape)  # (1, KVH, L, D), static by contract
        self.out_names = [o.name for o in session.get_outputs()]
        # a fused graph's present is the whole updated cache (kv_cache "in-place", with one
        # spare slot: see onnx_fused.py), a portable graph's only the n new slots
        self.in_place = any(o.name.startswith("present_") and o.shape[2] == self.kv_shape[2]
                            for o in session.get_outputs())
        self.max_len = self.kv_shape[2] - self.in_place
        rng = rng or np.random.default_rng(0)
        # stale slots hold finite garbage; the graph must mask it
        self.cache = {i.name: (3 * rng.standard_normal(self.kv_shape)).astype(np.float32) for i in pasts}
        self.position = 0

    def __call__(self, new_ids: list[int], num_logits: int) -> np.ndarray:
        """Feed tokens at self.position, write their K/V into the cache, advance; -> [num_logits, V]."""
        n = len(new_ids)
        if not 1 <= num_logits <= n or self.position + n > self.max_len:
            raise ValueError(f"bad call: n={n} num_logits={num_logits} position={self.position} max_len={self.max_len}")
        feeds = {
            "input_ids": np.asarray([new_ids], dtype=np.int64),
            "position": np.asarray(self.position, dtype=np.int64),
            "num_logits": np.asarray(num_logits, dtype=np.int64),
            **self.cache,
            **self.extra_feeds,
        }
        outs = dict(zip(self.out_names, self.session.run(self.out_names, feeds)))
        for name, new in outs.items():
            if name.startswith("present_"):
                past = "past_" + name[len("present_") :]
                if self.in_place:
                    assert new.shape == self.kv_shape, (name, new.shape)
                    self.cache[past] = new
                else:
                    assert new.shape[2] == n, (name, new.shape)
                    self.cache[past][:, :, self.position : self.position + n] = new
        self.position += n
        return outs["logits"][0]


@torch.no_grad()
def check_parity(
    hf_model,
    onnx_path,
    prompt_ids: list[int],
    *,
    prefill_chunk: int = 16,
    steps: int = 3,
    verify_len: int = 5,
    seed: int = 0,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> float:
    """Max |logits_onnx - logits_hf| over a speculative-decoding-shaped call sequence (see
    drive_calls), each call checked against a fresh HF forward over the same token sequence."""
    hf_model.eval()
    runner = NumpyCacheRunner(make_session(onnx_path, threads), np.random.default_rng(seed))

    def reference(tokens: list[int], num_logits: int) -> np.ndarray:
        return hf_model(torch.tensor([tokens]), use_cache=False).logits[0, -num_logits:].float().numpy()

    return drive_calls(runner, reference, prompt_ids, hf_model.config.vocab_size,
                       prefill_chunk=prefill_chunk, steps=steps, verify_len=verify_len,
                       rng=np.random.default_rng(seed + 1), log=log)


def drive_calls(
    runner: NumpyCacheRunner,
    reference: Callable[[list[int], int], np.ndarray],
    prompt_ids: list[int],
    vocab: int,
    *,
    prefill_chunk: int,
    steps: int,
    verify_len: int,
    rng: np.random.Generator,
    log: Callable[[str], None] | None = None,
) -> float:
    """Run the call sequence a runtime would and return the worst |logits - reference|:

    1. prefill `prompt_ids` in chunks of `prefill_chunk` (first chunk at position 0 returns all
       its rows, later chunks only the last row, as a runtime prefill would);
    2. `steps` single-token greedy steps;
    3. a verify call of `verify_len` draft tokens (all rows), then a rollback that keeps only
       half of them and a second verify call over the now-stale slots.
    `reference(tokens, num_logits)` gives the expected last num_logits rows for the whole
    sequence `tokens` whose K/V the cache holds after the call.
    """
    tokens: list[int] = []  # the sequence whose K/V sits in cache slots [0, position)
    worst = 0.0

    def call(new_ids: list[int], num_logits: int, what: str) -> np.ndarray:
        nonlocal worst
        pos = runner.position
        got = runner(new_ids, num_logits)
        del tokens[pos:]  # rollback: slots >= pos are stale
        tokens.extend(new_ids)
        diff = float(np.abs(got - reference(tokens, num_logits)).max())
        worst = max(worst, diff)
        if log:
            log(f"{what:>8} position={pos:<4} n={len(new_ids):<3} num_logits={num_logits:<3} max|diff|={diff:.3g}")
        return got

    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    for start in range(0, len(prompt_ids), prefill_chunk):
        chunk = list(prompt_ids[start : start + prefill_chunk])
        logits = call(chunk, len(chunk) if start == 0 else 1, "prefill")
    for _ in range(steps):
        logits = call([int(logits[-1].argmax())], 1, "step")
    draft = [int(logits[-1].argmax())] + rng.integers(0, vocab, verify_len - 1).tolist()
    call(draft, verify_len, "verify")
    runner.position -= verify_len - verify_len // 2  # keep half the drafts; the rest go stale
    call(rng.integers(0, vocab, verify_len).tolist(), verify_len, "verify")
    return worst


@torch.no_grad()
def quantized_parity(hf_model, onnx_path, prompts: list[list[int]], threads: int | None = None) -> dict:
    """Top-1 agreement and mean KL of a quantized decoder graph against the float PyTorch model,
    over every position of each prompt (one prefill call returning all rows)."""
    from .quantize import distribution_agreement

    session = make_session(onnx_path, threads)
    ref_rows, got_rows = [], []
    for ids in prompts:
        runner = NumpyCacheRunner(session)
        got_rows.append(runner(list(ids), len(ids)))
        ref_rows.append(hf_model(torch.tensor([list(ids)]), use_cache=False).logits[0].float().numpy())
    return distribution_agreement(np.concatenate(ref_rows), np.concatenate(got_rows))
