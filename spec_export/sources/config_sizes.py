"""A model's sizes, checked from its configuration before transformers builds (allocates) it.

transformers trusts config.json: `num_hidden_layers: 1000000` builds layers for minutes while
memory grows, `hidden_size: 1048576` allocates terabytes before failing, `num_attention_heads:
0` divides by zero inside its validation. Here each family's size fields (FAMILIES, for every
family models.SUPPORTED and models.ENCODER_DECODER export) are checked to be positive integers
that divide as the architecture needs, and the parameter count they imply is weighed against
the parameters saved with the config (a size that is not the weights') and against the memory
this machine has (the export holds the model in float32, 4 bytes a parameter). Fields a config
leaves out take the defaults of transformers' config class, as loading would.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

from spec_runtime.errors import BuildError

FLOAT32_BYTES = 4
# a config that makes this many times more parameters than the weights saved with it does not
# describe them (an edited size); well above what packed quantized checkpoints (8 int4 values
# an int32) or an embedding counted twice can account for
STORED_FACTOR = 16


@dataclass(frozen=True)
class Fields:
    """The config names of one family's sizes (None: the family has no such field)."""
    layers: tuple[str, ...]
    hidden: str
    heads: str
    kv_heads: str | None
    head_dim: str | None
    ffn: str | None
    positions: str | None
    optional: tuple[str, ...]  # may be null: derived from the others
    vocab: str = "vocab_size"
    others: tuple[str, ...] = ()  # more sizes that must be positive integers

    def sizes(self) -> list[str]:
        return [n for n in (*self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim,
                            self.ffn, self.positions, self.vocab, *self.others) if n]


LLAMA = Fields(("num_hidden_layers",), "hidden_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
               optional=("num_key_value_heads", "head_dim", "max_position_embeddings"))
GPT2 = Fields(("n_layer",), "n_embd", "n_head", None, None, "n_inner", "n_positions",
              optional=("n_inner",))
T5 = Fields(("num_layers", "num_decoder_layers"), "d_model", "num_heads", None, "d_kv", "d_ff",
            None, optional=("num_decoder_layers",))


WHISPER = Fields(("encoder_layers", "decoder_layers"), "d_model", "encoder_attention_heads", None,
                 None, "encoder_ffn_dim", "max_target_positions", optional=(),
                 others=("decoder_attention_heads", "decoder_ffn_dim", "num_mel_bins",
                         "max_source_positions"))


def _llama_parameters(c: dict) -> int:
    """Embedding (and an untied head), and per layer q, k, v, o and a gated MLP (3 matrices)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * c["intermediate_size"]
    heads_of_vocab = 1 if c.get("tie_word_embeddings") else 2
    return c["vocab_size"] * hidden * heads_of_vocab + c["num_hidden_layers"] * (attention + mlp)


def _gpt2_parameters(c: dict) -> int:
    """Token and position embeddings, and per layer qkv, the projection and a 2-matrix MLP."""
    hidden = c["n_embd"]
    inner = c.get("n_inner") or 4 * hidden
    return (c["vocab_size"] + c["n_positions"]) * hidden + c["n_layer"] * (
        4 * hidden * hidden + 2 * hidden * inner)


def _t5_parameters(c: dict) -> int:
    """Shared embedding (and an untied head); encoder layers self-attention + FFN, decoder
    layers self- and cross-attention + FFN (gated: 3 matrices)."""
    d, inner = c["d_model"], c["num_heads"] * c["d_kv"]
    ffn = (3 if str(c.get("feed_forward_proj", "")).startswith("gated") else 2) * d * c["d_ff"]
    attention = 4 * d * inner
    decoder_layers = c.get("num_decoder_layers") or c["num_layers"]
    head = 1 if c.get("tie_word_embeddings", True) else 2
    return (c["vocab_size"] * d * head + c["num_layers"] * (attention + ffn)
            + decoder_layers * (2 * attention + ffn))


def _whisper_parameters(c: dict) -> int:
    """The two convolutions, both position tables, the tied embedding; encoder layers
    self-attention + FFN, decoder layers self- and cross-attention + FFN."""
    d = c["d_model"]
    front = 3 * d * (c["num_mel_bins"] + d)
    positions = (c["max_source_positions"] + c["max_target_positions"]) * d
    return (front + positions + c["vocab_size"] * d
            + c["encoder_layers"] * (4 * d * d + 2 * d * c["encoder_ffn_dim"])
            + c["decoder_layers"] * (8 * d * d + 2 * d * c["decoder_ffn_dim"]))


# HF model_type -> its size fields and parameter count; a type not here (refused later by the
# export) is read as Llama-like where it has those fields
FAMILIES = {"llama": (LLAMA, _llama_parameters), "qwen2": (LLAMA, _llama_parameters),
            "qwen3": (LLAMA, _llama_parameters), "mistral": (LLAMA, _llama_parameters),
            "gemma3_text": (LLAMA, _llama_parameters), "gpt2": (GPT2, _gpt2_parameters),
            "t5": (T5, _t5_parameters), "whisper": (WHISPER, _whisper_parameters)}


def with_defaults(config: dict) -> dict:
    """`config` over the defaults transformers' config class for its model_type declares (what
    a field left out becomes on loading); a field declared None is derived from the others
    (head_dim from hidden_size and heads, say) and stays out. Unknown types as they are."""
    import inspect

    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return dict(config)
    declared = inspect.signature(CONFIG_MAPPING[model_type]).parameters.items()
    defaults = {name: p.default for name, p in declared
                if p.default is not inspect.Parameter.empty and p.default is not None}
    return {**defaults, **config}


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def check_config(config: dict, named: str, where: str, fix: str, labels: dict | None = None,
                 stored: int | None = None) -> int | None:
    """Refuse a config (`where`, e.g. "config.json", of the model `named`) whose sizes are not
    positive integers, do not divide as the architecture needs, make far more parameters than
    the `stored` ones (the saved weights' count, where known), or a model larger than this
    machine's memory; returns its parameter count (None for a family not in FAMILIES).
    `fix` ends a message about a wrong value; `labels` names a field as `where` spells it (a
    GGUF's metadata keys), where that differs from the config's name."""
    c = with_defaults(config)
    fields, parameters = FAMILIES.get(c.get("model_type"), (LLAMA, None))

    def said(name: str) -> str:
        return f"{(labels or {}).get(name, name)} {c.get(name)!r}"

    for name in fields.sizes():
        may_lack = parameters is None or name in fields.optional
        if not (c.get(name) is None and may_lack) and not _positive_int(c.get(name)):
            raise BuildError(f"{named}: {where} has {said(name)}, which must be a positive "
                             f"integer: {fix}")
    heads, kv = c.get(fields.heads), c.get(fields.kv_heads) if fields.kv_heads else None
    if heads and kv and heads % kv:
        raise BuildError(f"{named}: {where} has {said(fields.heads)}, not a multiple of "
                         f"{said(fields.kv_heads)} (each key-value head serves a whole group of "
                         f"query heads): {fix}")
    hidden = c.get(fields.hidden)
    derived = fields.head_dim is None or (fields is LLAMA and not c.get(fields.head_dim))
    if hidden and heads and derived and hidden % heads:
        raise BuildError(f"{named}: {where} has {said(fields.hidden)}, not a multiple of "
                         f"{said(fields.heads)} (each head takes an equal share): {fix}")
    if parameters is None:
        return None
    count = parameters(c)
    sizes = ", ".join(said(n) for n in fields.sizes() if c.get(n) is not None)
    if stored and count > STORED_FACTOR * stored:
        raise BuildError(f"{named}: {where} describes a model of {count:,} parameters, and the "
                         f"saved weights hold {stored:,}: a size in {where} is not the weights' "
                         f"({sizes}): {fix}")
    _check_memory(count, sizes, named, where)
    return count


def _check_memory(count: int, sizes: str, named: str, where: str) -> None:
    need = count * FLOAT32_BYTES
    have = available_memory()
    if have is None or need <= have[0]:
        return
    raise BuildError(f"{named}: {where} describes a model of {count:,} parameters, "
                     f"{_gb(need)} in float32 (the export holds the model in float32), and "
                     f"{have[1]} {_gb(have[0])}: check the sizes in {where} ({sizes}), or "
                     f"build on a machine with more memory")


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n < 1e15 else f"{n:.3g} bytes"


def available_memory() -> tuple[int, str] | None:
    """(bytes this process can still allocate, what they are), or None where the system does
    not say: the memory the kernel reports available (MemAvailable), and no more than the
    address space a limit (RLIMIT_AS) leaves to this process."""
    have = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = (int(line.split()[1]) * 1024, "this machine has available")
    except OSError:
        pass
    if have is None:
        try:
            have = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                    "this machine has available")
        except (ValueError, OSError, AttributeError):
            pass
    limit = _address_space_left()
    if limit is not None and (have is None or limit < have[0]):
        have = (limit, "the address space limit (ulimit -v) leaves this process")
    return have


def _address_space_left() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    try:
        with open("/proc/self/status") as f:
            used = next((int(line.split()[1]) * 1024 for line in f
                         if line.startswith("VmSize:")), 0)
    except OSError:
        pass
    return max(0, soft - used)
