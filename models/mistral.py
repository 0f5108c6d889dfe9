"""Export-friendly Mistral forward over Hugging Face `MistralForCausalLM` weights.

Llama's block (models/llama.py) with an optional sliding window on every layer: transformers'
Mistral masks with `config.sliding_window` wherever it is set (Mistral 7B v0.1: 4096; later
versions: null) and ignores `layer_types`. An explicit `head_dim` is read as Llama reads it.
"""

from __future__ import annotations

from .llama import Llama, LlamaDims


class Mistral(Llama):
    model_type = "mistral"

    @classmethod
    def dims(cls, config, max_len: int) -> LlamaDims:
        window = getattr(config, "sliding_window", None)
        # a window of max_len or more never hides a key from a cache of max_len slots
        windows = (window,) * config.num_hidden_layers if window and window < max_len else ()
        return LlamaDims.from_config(config, cls.model_type, windows=windows)
