"""What every parity run shares, for a decoder-only model and an encoder-decoder alike: the
runtime's engine over exported graph files, the Hugging Face model's reference rows, and the
call sequence.

The graphs run through the runtime's own engine (spec_runtime.engines.opener.open_graph: the
same session options, cache store and IOBinding a deployed bundle uses), driven the way the
decode loop drives it: chunked prefill, steps, verify calls, rollback by moving the position
(rejected slots keep their stale K/V and must be masked), logits only for the last
`num_logits` rows. The cache starts as finite garbage, not zeros, so a masking bug cannot hide
behind zero-valued slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from spec_runtime.engines.opener import open_graph
from spec_runtime.errors import BuildError
from spec_runtime.bundle.manifest import GraphEntry

# the call sequence (plan_calls): prefill chunks, single steps, the verify calls' length. An
# encoder-decoder's decoder prompt is its start token and a few of the parity text's ids, which
# chunks of SEQ2SEQ_PREFILL_CHUNK still prefill in two calls.
PREFILL_CHUNK = 16
SEQ2SEQ_PREFILL_CHUNK = 3
STEPS = 3
VERIFY_LEN = 5

# why a model's logits are not finite, and the fix: a damaged weight (NaN, or a tensor read with
# another type's layout) in the PyTorch model, and in the graph also what the export changed
DAMAGED_WEIGHTS = ("its weights are damaged (a NaN or infinite weight, or a tensor stored in "
                   "another type than its file says): download the model again")
GRAPH_NOT_FINITE = ("where the PyTorch model's are finite: the graph does not compute the model "
                    "(damaged quantized blocks, or an overflow at this precision); download the "
                    "model again, or build at a higher precision")


def require_finite(rows: np.ndarray, what: str, why: str) -> None:
    """Refuse logits that are not all finite. A NaN compares false with everything, so it would
    pass any tolerance (max(0.0, nan) is 0.0) and land in the manifest as invalid JSON."""
    bad = ~np.isfinite(rows)
    if bad.any():
        raise BuildError(f"{what} are not finite ({int(bad.sum())} of {bad.size} values NaN or "
                         f"infinite) on the parity tokens: {why}")


def graph_dims(graph: GraphEntry) -> tuple[int, int]:
    """(max_len, vocab_size) of a decoder graph's description."""
    shapes = {io["name"]: io["shape"] for io in graph.inputs + graph.outputs}
    return (shapes["past_key.0"][2] - (graph.kv_cache == "in-place"),
            shapes["logits"][-1])


def open_decoder(path, threads: int | None = None, seed: int = 0, one_row: str = "as-is", *,
                 encoder_path=None):
    """The runtime's engine over a decoder graph file (with `encoder_path`, over an
    encoder-decoder's two graph files), its cache filled with garbage; its 1-token calls in
    `one_row` form ("auto": the form the runtime measures at load)."""
    from ..graphs.onnx_export import graph_entry

    graph = graph_entry(path)
    max_len, vocab = graph_dims(graph)
    common = dict(vocab_size=vocab, max_len=max_len, prefill_chunk=max_len, threads=threads,
                  garbage_seed=seed, one_row=one_row)
    if encoder_path is None:
        return open_graph(path, graph, where=f"exported {Path(path).name}", **common)
    encoder = graph_entry(encoder_path)
    first = encoder.inputs[0]["shape"]
    # the encoder's output length: a token source is [1, max_source_len]; a speech window is
    # [1, n_mels, frames], which the encoder's stride-2 convolution halves
    S = first[2] // 2 if len(first) == 3 else first[1]
    return open_graph(path, graph, encoder=(encoder_path, encoder), max_source_len=S,
                      where="exported", **common)


def trim_output_head(hf_model, ids) -> None:
    """Cut a Hugging Face model's output head to the rows `ids` (a trimmed draft's kept ids), so
    that its logits compare id for id with the trimmed graph's; the input embedding stays whole
    (a tied head gets its own copy of those rows)."""
    head = hf_model.get_output_embeddings()
    rows = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    trimmed = torch.nn.Linear(head.in_features, len(rows), bias=head.bias is not None)
    trimmed.weight.data = head.weight.data.index_select(0, rows).clone()
    if head.bias is not None:
        trimmed.bias.data = head.bias.data.index_select(0, rows).clone()
    hf_model.set_output_embeddings(trimmed)


def hf_reference(hf_model, source_inputs: dict | None = None,
                 dtype=torch.float32) -> Callable[[list[int], int], np.ndarray]:
    """reference(tokens, num_logits): the last num_logits rows of a fresh HF forward over
    `tokens` (an encoder-decoder's decoder tokens over its `source_inputs`), in `dtype`."""
    hf_model.eval()

    def reference(tokens: list[int], num_logits: int) -> np.ndarray:
        with torch.no_grad():
            if source_inputs is None:
                out = hf_model(torch.tensor([tokens]), use_cache=False)
            else:
                out = hf_model(**source_inputs, decoder_input_ids=torch.tensor([tokens]),
                               use_cache=False)
        return out.logits[0, -num_logits:].to(dtype).numpy()

    return reference


@dataclass(frozen=True)
class Call:
    """One engine call of a parity run and the rows the reference model gives for it."""
    position: int
    ids: list[int]
    num_logits: int
    want: np.ndarray  # [num_logits, V]
    what: str


def plan_calls(
    reference: Callable[[list[int], int], np.ndarray],
    prompt_ids: list[int],
    vocab: int,
    max_len: int,
    *,
    prefill_chunk: int = PREFILL_CHUNK,
    steps: int = STEPS,
    verify_len: int = VERIFY_LEN,
    rng: np.random.Generator,
    name: str = "the model",
) -> list[Call]:
    """The call sequence a runtime would make, with the reference's rows for each:

    1. prefill `prompt_ids` in chunks of `prefill_chunk` (first chunk at position 0 returns all
       its rows, later chunks only the last row, as a runtime prefill would);
    2. `steps` single-token greedy steps (greedy on the reference's rows, so that every graph
       checked against one plan is driven through the same tokens);
    3. a verify call of `verify_len` draft tokens (all rows), then a rollback that keeps only
       half of them and a second verify call over the now-stale slots.
    `reference(tokens, num_logits)` gives the expected last num_logits rows for the whole
    sequence `tokens` whose K/V the cache holds after the call. The plan holds only numbers:
    the model that computed it can be released before any graph runs (a big model and its
    graph need not be in memory together). Rows that are not finite are refused (`name`
    names the model).
    """
    tokens: list[int] = []  # the sequence whose K/V sits in cache slots [0, position)
    calls: list[Call] = []
    position = 0

    def call(new_ids: list[int], num_logits: int, what: str) -> np.ndarray:
        nonlocal position
        pos = position
        position += len(new_ids)
        del tokens[pos:]  # rollback: slots >= pos are stale
        tokens.extend(new_ids)
        want = reference(tokens, num_logits)
        require_finite(want, f"{name}: the PyTorch model's logits", DAMAGED_WEIGHTS)
        calls.append(Call(pos, list(new_ids), num_logits, want, what))
        return want

    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    # the whole sequence must fit the cache: prompt, steps, a verify, half of one more
    fit = max_len - steps - verify_len - verify_len // 2
    if fit < 1:  # a tiny cache (--max-len 8..10): the shortest sequence of each kind
        steps, verify_len = 1, 2
        fit = max_len - steps - verify_len - verify_len // 2
    prompt_ids = list(prompt_ids)[:fit]
    for start in range(0, len(prompt_ids), prefill_chunk):
        chunk = list(prompt_ids[start : start + prefill_chunk])
        logits = call(chunk, len(chunk) if start == 0 else 1, "prefill")
    for _ in range(steps):
        logits = call([int(logits[-1].argmax())], 1, "step")
    draft = [int(logits[-1].argmax())] + rng.integers(0, vocab, verify_len - 1).tolist()
    call(draft, verify_len, "verify")
    position -= verify_len - verify_len // 2  # keep half the drafts; the rest go stale
    call(rng.integers(0, vocab, verify_len).tolist(), verify_len, "verify")
    return calls


def run_calls(engine, calls: list[Call], log: Callable[[str], None] | None = None,
              name: str = "the graph") -> float:
    """Make `calls` on `engine` in order; the worst |logits - reference| over all of them.
    Logits that are not finite are refused (`name` names the graph)."""
    from ..bundle.progress import note

    worst = 0.0
    for i, c in enumerate(calls, 1):
        note(f"{name}: call {i}/{len(calls)}")
        got = engine.forward(np.asarray(c.ids, np.int64), c.position, c.num_logits)
        require_finite(got, f"{name}: the exported graph's logits", GRAPH_NOT_FINITE)
        diff = float(np.abs(got - c.want).max())
        worst = max(worst, diff)
        if log:
            log(f"{c.what:>8} position={c.position:<4} n={len(c.ids):<3} "
                f"num_logits={c.num_logits:<3} max|diff|={diff:.3g}")
    return worst


def followed_tokens(engine, follow: list[tuple[list[int], list[int]]]) -> list[int]:
    """For each (prompt, float greedy continuation): how many tokens the graph's own greedy
    decoding of the prompt agrees with the continuation before it first differs. Teacher-forced
    on the continuation, one call: up to the first difference the two decodings read the same
    tokens, so the count is exactly that of a step-by-step greedy run."""
    counts = []
    for ids, continuation in follow:
        tokens = np.asarray(list(ids) + continuation[:-1], np.int64)
        rows = engine.forward(tokens, 0, len(continuation))
        differs = np.flatnonzero(rows.argmax(-1) != np.asarray(continuation))
        counts.append(int(differs[0]) if len(differs) else len(continuation))
    return counts
