"""What is checked of a model source before transformers reads it: a GGUF file's structure
(gguf_check.py) and the sizes its configuration asks for (config_sizes.py), so that a damaged
or hostile file is refused in one line instead of a traceback or an allocation without bound."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from spec_runtime.errors import BuildError

from .config_sizes import FAMILIES, LLAMA, check_config
from .gguf_check import DAMAGED, ArrayValue, GGUFDamaged, GGUFLayout, read_layout

MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KB; past this it is not one
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit
# a GGUF architecture whose Hugging Face model_type differs (transformers' GGUF loader does the
# same): Gemma 3 files hold the text model only
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}
CONFIG_FIX = "correct it in config.json (it must describe the saved weights)"


def check_source(spec, named: str, offline: bool) -> None:
    """Refuse `spec` (a source.ModelSpec, `named` for messages) before it is loaded: a GGUF
    whose structure is damaged, or a config whose sizes are invalid or too large for this
    machine. `offline`: a hub id is read from the local cache only."""
    if spec.gguf_file:
        path = spec.gguf_path()
        layout = check_gguf_file(path, named)
        config, keys = _gguf_config(layout)
        _check_blocks(layout, config, named)
        check_config(config, named, "the GGUF metadata", DAMAGED, keys,
                     stored=sum(math.prod(t.shape) for t in layout.tensors))
        return
    config = _config_json(spec, offline, named)
    if config is not None:
        check_config(config, named, "config.json", CONFIG_FIX,
                     stored=_safetensors_parameters(Path(spec.source).expanduser()))


def check_gguf_file(path, named: str) -> GGUFLayout:
    try:
        return read_layout(path)
    except GGUFDamaged as e:
        raise BuildError(f"{named}: {path}: {e}: {DAMAGED}") from None


def _gguf_config(layout: GGUFLayout) -> tuple[dict, dict]:
    """(the Hugging Face config sizes transformers makes of the GGUF's metadata, through its
    own key mapping; {config name: the GGUF key}, for messages). Read from the checked layout:
    gguf-py's reader takes seconds over a vocabulary that is not needed here."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    meta = layout.metadata
    arch = meta.get("general.architecture")
    model_type = GGUF_MODEL_TYPES.get(arch, arch)
    config, keys = {"model_type": model_type}, {}
    for key, name in GGUF_CONFIG_MAPPING.get(arch, {}).items():
        value = meta.get(f"{arch}.{key}")
        if name and value is not None and not isinstance(value, ArrayValue):
            config[name], keys[name] = value, f"{arch}.{key}"
    tokens = meta.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, ArrayValue):
        config["vocab_size"] = tokens.count
        keys["vocab_size"] = "tokenizer.ggml.tokens (its length)"
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in layout.tensors)
    return config, keys


def _check_blocks(layout: GGUFLayout, config: dict, named: str) -> None:
    """A block_count beyond the blocks the file holds would have transformers build (and
    randomly initialise) the missing ones."""
    fields, _ = FAMILIES.get(config.get("model_type"), (LLAMA, None))
    declared = config.get(fields.layers[0])
    blocks = layout.blocks()
    if blocks and isinstance(declared, int) and declared > max(blocks) + 1:
        raise BuildError(f"{named}: the GGUF metadata has block_count {declared}, and the file "
                         f"holds the tensors of {len(blocks)} blocks (blk.0 to blk."
                         f"{max(blocks)}): {DAMAGED}")


def _safetensors_parameters(directory: Path) -> int | None:
    """The parameter count of a directory's safetensors weights, from their headers only (an
    8-byte length, then JSON with each tensor's shape); None where they cannot be told so."""
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                                .values()))
        elif (directory / "model.safetensors").is_file():
            shards = ["model.safetensors"]
        else:
            return None
        total = 0
        for shard in shards:
            with open(directory / shard, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                if size > MAX_SAFETENSORS_HEADER:
                    return None
                header = json.loads(f.read(size))
            total += sum(math.prod(t["shape"]) for name, t in header.items()
                         if name != "__metadata__")
        return total
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return None  # transformers reads them next and says what is wrong


def _config_json(spec, offline: bool, named: str) -> dict | None:
    """config.json of a directory or a hub id (through the local cache when `offline`), as
    written, before transformers validates or completes it; None where there is none."""
    local = Path(spec.source).expanduser()
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            return None  # transformers says what is missing
    else:
        from transformers.utils import cached_file

        path = Path(cached_file(spec.source, "config.json", local_files_only=offline))
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise BuildError(f"{named}: {path} is {path.stat().st_size:,} bytes, which no model "
                         f"config is: give the model's own config.json")
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise BuildError(f"{named}: {path} holds a JSON {type(config).__name__}, not an object: "
                         f"give the model's own config.json")
    return config
