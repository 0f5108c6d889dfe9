"""A quantized decoder graph against the float model it came from: its logits differ by design,
so it is judged by how often it picks the same next token, how far its distribution moves
(mean KL), and how long its greedy decoding follows the float model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .calls import DAMAGED_WEIGHTS, GRAPH_NOT_FINITE, followed_tokens, open_decoder, require_finite
from .quality import FOLLOW_TOKENS


@torch.no_grad()
def reference_rows(hf_model, prompts: list[list[int]], max_len: int) -> list[np.ndarray]:
    """Every row of the float model's logits for each prompt (cut to the cache)."""
    hf_model.eval()
    return [hf_model(torch.tensor([list(ids)[:max_len]]), use_cache=False).logits[0].float().numpy()
            for ids in prompts]


def greedy_continuations(hf_model, prompts: list[list[int]], max_len: int,
                         n: int = FOLLOW_TOKENS) -> list[tuple[list[int], list[int]]]:
    """(prompt, the float model's greedy continuation of up to `n` tokens) for each prompt, cut
    so that both fit the graph's cache: what quantized_parity counts a graph's greedy decoding
    following."""
    from transformers import GenerationConfig

    hf_model.eval()
    # greedy and nothing else: not the model's own defaults (a repetition penalty, sampling)
    pairs = []
    with torch.no_grad():
        for ids in prompts:
            ids = list(ids)[: max_len - 1]
            room = min(n, max_len - len(ids))
            config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                      max_new_tokens=room)
            out = hf_model.generate(torch.tensor([ids]), generation_config=config)
            pairs.append((ids, out[0, len(ids):].tolist()))
    return pairs


def quantized_parity(reference, onnx_path, prompts: list[list[int]],
                     threads: int | None = None, follow=None) -> dict:
    """Top-1 agreement and mean KL of a quantized decoder graph against the float model, over
    every position of each prompt (one prefill call returning all rows). `reference` is the
    float PyTorch model or its reference_rows for these prompts at the graph's max_len.
    With `follow` (greedy_continuations), also "follows_float": how many tokens of each the
    graph's greedy decoding keeps to, of "follow_tokens"."""
    from ..quantization.quantize import distribution_agreement

    name = Path(onnx_path).stem
    engine = open_decoder(onnx_path, threads)
    if not isinstance(reference, list):
        reference = reference_rows(reference, prompts, engine.max_len)
    reference = np.concatenate(reference)
    require_finite(reference, f"{name}: the float PyTorch model's logits", DAMAGED_WEIGHTS)
    got_rows = []
    for ids in prompts:
        ids = list(ids)[: engine.max_len]  # a small --max-len holds a prefix of each
        got_rows.append(engine.forward(np.asarray(ids, np.int64), 0, len(ids)).copy())
    got = np.concatenate(got_rows)
    require_finite(got, f"{name}: the exported graph's logits", GRAPH_NOT_FINITE)
    agree = distribution_agreement(reference, got)
    if follow:
        agree["follows_float"] = followed_tokens(engine, follow)
        agree["follow_tokens"] = [len(c) for _, c in follow]
    return agree
