"""Pieces shared by the export-friendly decoders: the graph contract's forward signature,
the two-block cached attention, and a weight map that checks every Hugging Face tensor.

Every decoder here is the portable ("new-slots") form of the graph contract in
spec_runtime/bundle/contract.py: for n new tokens at absolute `position` it reads the static cache
`past_*` (slots >= position are stale: a rejected draft is never erased, it is masked until
overwritten) and returns the logits of the last num_logits tokens and the n new slots as
`present_*`, which the runtime writes at [position, position + n). The fused ("in-place") graph
of the Llama-based families (llama, qwen2, qwen3, mistral, gemma3_text) is written from the same
modules by spec_export/graphs/onnx_fused.py.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from spec_runtime.errors import InputError


class UnsupportedModel(InputError):
    """A checkpoint whose architecture, configuration or weights the export does not cover."""


class CachedDecoder(nn.Module):
    """Base for decoders that follow the graph contract above.

    Subclasses set the dims below and implement
    `forward(input_ids, position, num_logits, *past) -> (logits, *present)`, with `past` and
    `present` flattened as (key.0, value.0, key.1, value.1, ...).
    """

    model_type: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_len: int
    vocab_size: int

    def cache_shape(self) -> tuple[int, int, int, int]:
        return (1, self.n_kv_heads, self.max_len, self.head_dim)

    def untie_lm_head(self) -> None:
        """Give the lm_head its own copy of a tied embedding. A weight-only quantizer can then
        quantize the head's MatMul (read in full every step) while the embedding, of which a
        step gathers only a few rows, stays float."""
        if self.lm_head is self.embed:
            self.lm_head = param(self.embed.data.clone())

    def trim_lm_head(self, ids) -> None:
        """Keep only the lm_head rows `ids` (sorted token ids): the logits are then over those
        ids alone, in their order, and cost a step their rows only. The embedding stays whole
        (a tied one is no longer shared): the model still reads every token."""
        rows = torch.as_tensor(ids, dtype=torch.int64)
        self.lm_head = param(self.lm_head.data.index_select(0, rows))  # a copy of those rows
        self.vocab_size = len(rows)


def step_masks(n: int, position: torch.Tensor, max_len: int):
    """What n new queries at absolute positions position .. position+n-1 may see.

    Returns (past_len, causal [n, n] bool: key t' <= query t). past_len is `position` as a
    symbolic int: the valid cache slots are exactly 0..past_len-1, so attention reads that prefix
    of the static cache and never the stale slots past it. Reading only the prefix makes a step
    cost grow with the position, not with max_len (a 2048-slot cache read in full was a third of
    a step at position 100).
    """
    past_len = position.item()
    torch._check(past_len >= 0)
    torch._check(past_len <= max_len)
    return past_len, causal_mask(n, position.device)


def causal_mask(n: int, device=None) -> torch.Tensor:
    """[n, n] bool: key t' <= query t."""
    t = torch.arange(n, device=device)
    return t[None, :] <= t[:, None]


# -- lanes: L sequences in one call (spec_runtime/bundle/contract.py, decoder_lanes) ---------
#
# A lanes forward reads input_ids [L, n], position [L] (each lane's own), num_logits and
# row_ends [L] (where each lane's logit rows end: lanes are right-padded), and each lane's own
# caches. Everything but attention sees all L·n rows at once; attention runs once per lane,
# exactly as the batch-1 forward runs it over that lane's cache. A decoder block takes one
# context per lane and, with one lane, runs exactly the batch-1 forward (no slicing), so the
# batch-1 graph is what it was.

def lane_lengths(position: torch.Tensor, lanes: int, max_len: int) -> list:
    """position int64 [L] -> each lane's valid cache prefix (step_masks' past_len), symbolic."""
    out = []
    for b in range(lanes):
        past_len = position[b].item()
        torch._check(past_len >= 0)
        torch._check(past_len <= max_len)
        out.append(past_len)
    return out


def lane(t: torch.Tensor, b: int, lanes: int) -> torch.Tensor:
    """Lane b's rows [1, ...] of t [L, ...] (t itself when there is one lane)."""
    return t if lanes == 1 else t[b : b + 1]


def lanes_cat(parts: list) -> torch.Tensor:
    """The lanes' rows [1, ...] back as one [L, ...] (the one part itself for one lane)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def lane_kv(args, n_layers: int, lanes: int, layer: int, b: int) -> tuple:
    """(key, value) of `layer`, lane b, from a flat list in contract.lane_kv_names' order
    (layer, lane, key then value)."""
    j = 2 * (layer * lanes + b)
    return args[j], args[j + 1]


def lane_rows(x: torch.Tensor, row_ends: torch.Tensor, num_logits) -> torch.Tensor:
    """x [L, n, C] -> [L, K, C], K = num_logits: lane b's rows [row_ends[b] - K, row_ends[b]).
    Each lane's rows are first rotated so that its row_ends[b] - 1 is the last row (a gather
    of computed indices), then the last K rows are taken as the batch-1 forward takes them."""
    L, n, C = x.shape
    shift = row_ends[:, None] - n + torch.arange(n)  # [L, n]: row t <- row t + row_ends - n
    idx = torch.where(shift < 0, shift + n, shift)  # row_ends <= n: at most one turn
    x = torch.gather(x, 1, idx[:, :, None].expand(L, n, C))
    return x[:, n - num_logits :]


def cached_attention(
    q: torch.Tensor,  # [1, KVH, G, n, D], already scaled
    k_new: torch.Tensor,  # [1, KVH, n, D]
    v_new: torch.Tensor,  # [1, KVH, n, D]
    past_k: torch.Tensor,  # [1, KVH, L, D]
    past_v: torch.Tensor,  # [1, KVH, L, D]
    past_len,  # int (symbolic in the graph): slots 0..past_len-1 are valid
    causal: torch.Tensor,  # [n, n] bool
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([1, KVH, G*n, P], [1, KVH, G*n, n])
    window: int | None = None,
) -> torch.Tensor:
    """Attention over the valid cache prefix plus the new tokens; returns [1, KVH, G, n, D].

        past_k[:P] ─┐                                                        past_v[:P] ─┐
                    Concat ─ MatMul(q, ·ᵀ) ─ (+bias) ─ Where(visible) ─ Softmax ─ MatMul(Concat)
        k_new ──────┘                                                        v_new ──────┘

    P = past_len. Slots P..max_len-1 hold stale K/V of rejected drafts; they are never read.
    A row's scores and its weighted sum are each one product over the whole key sequence
    (prefix and new tokens together), so a position is computed the same way in a 1-token
    step and in a verify call of any length: the keys a longer call adds are masked, and a
    masked key adds an exact 0 (spec_runtime/engines/rows.py checks the result on each machine). `bias`
    is an optional additive score bias per block (T5's relative position bias), given on the
    folded row axis.

    `window` (a sliding-window layer) hides, as Hugging Face's mask does, every key more than
    window - 1 positions before its query: the query at position i sees keys
    i - window < j <= i. The static cache still holds every slot; the window is a mask over
    positions, so rollback stays a position here too.

    G query heads share one KV head (GQA). Folding G into the row axis ([1, KVH, G*n, D]) lets
    each KV head be used as is: no repeated K/V is materialised, and every MatMul is a plain
    batched GEMM. Every row keeps its own diagonal, so the softmax never sees a row of only -inf.
    """
    _, kvh, g, n, d = q.shape
    q = q.reshape(1, kvh, g * n, d)  # [1, KVH, G*n, D]
    k = torch.cat([past_k[:, :, :past_len], k_new], dim=2)  # [1, KVH, P+n, D]
    v = torch.cat([past_v[:, :, :past_len], v_new], dim=2)  # [1, KVH, P+n, D]
    s = q @ k.transpose(-1, -2)  # [1, KVH, G*n, P+n]
    if bias is not None:
        s = s + torch.cat(bias, dim=-1)
    # query t sees the whole prefix and the new keys t' <= t; row r of the folded axis is
    # query t = r % n, so the mask repeats G times
    visible = torch.cat([causal.new_ones(n, past_len), causal], dim=-1)  # [n, P+n]
    if window is not None:
        key_pos = torch.arange(past_len + n, device=q.device)  # [P+n]
        query_pos = past_len + torch.arange(n, device=q.device)  # [n]
        visible = visible & (key_pos[None, :] > query_pos[:, None] - window)  # [n, P+n]
    visible = visible.expand(g, n, past_len + n).reshape(g * n, past_len + n)  # [G*n, P+n]
    s = torch.where(visible, s, torch.tensor(float("-inf"), dtype=q.dtype))
    probs = torch.softmax(s, dim=-1)  # [1, KVH, G*n, P+n]
    return (probs @ v).reshape(1, kvh, g, n, d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # same operation order as HF's LlamaRMSNorm and T5LayerNorm, so float32 rounding matches
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


_consuming: contextvars.ContextVar = contextvars.ContextVar("consuming", default=None)


@contextlib.contextmanager
def consuming(hf_model):
    """Within this block, building a forward from `hf_model` spends it: each of its tensors is
    dropped from the model as soon as its float32 copy is made, so that a model of several GB is
    never held twice (a 1.5B model is 6.2 GB in float32). The HF model is unusable afterwards;
    take what is needed of it (config, reference logits) before."""
    token = _consuming.set(hf_model)
    try:
        yield
    finally:
        _consuming.reset(token)


class WeightMap:
    """Hands out Hugging Face tensors by name, checking each shape, and fails if any is left over.

    nanoGPT-style: the mapping is spelled out name by name in the model file, and nothing in the
    checkpoint may be silently ignored. Under `consuming(model)`, each name taken is dropped from
    `state_dict` and from the model, so that the tensor's memory goes once its last name is
    taken (tied names share one tensor).
    """

    def __init__(self, state_dict: dict[str, torch.Tensor], source: str):
        self._owner = _consuming.get()
        # consuming: the caller's own dict, emptied as names are taken (a copy would keep them)
        self._sd = state_dict if self._owner is not None else dict(state_dict)
        self._source = source

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._sd:
            near = [k for k in self._sd if k.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            raise UnsupportedModel(f"{self._source}: weight {name!r} missing from the state dict; similar: {near}")
        t = self._sd.pop(name)
        if tuple(t.shape) != tuple(shape):
            raise UnsupportedModel(f"{self._source}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        # float32 copy: the graph is float32, and the copy keeps our module independent of HF's
        copy = t.detach().to(torch.float32).clone()
        if self._owner is not None:
            _drop(self._owner, name)
        return copy

    def take_optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, shape) if name in self._sd else None

    def finish(self) -> None:
        if self._sd:
            raise UnsupportedModel(f"{self._source}: weights not mapped (the forward would ignore them): {sorted(self._sd)}")


def _drop(model: nn.Module, name: str) -> None:
    """Remove the parameter or buffer `name` (a state_dict key) from `model`."""
    path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return
    for table in (module._parameters, module._buffers):
        if table.get(attr) is not None:
            table[attr] = None


def param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)
