"""Export-friendly Qwen2 / Qwen2.5 forward over Hugging Face `Qwen2ForCausalLM` weights.

Llama's block (models/llama.py) with biases on q, k and v but not on o, tied or untied
embeddings, and a sliding window exactly where transformers applies one: only with
`use_sliding_window`, on the layers `config.layer_types` marks "sliding_attention" (by default
those from `max_window_layers` on). Qwen2.5 checkpoints that turn on yarn RoPE for long contexts
are refused by name (models/llama.rope_inv_freq).
"""

from __future__ import annotations

from .llama import Llama, LlamaDims, layer_windows


class Qwen2(Llama):
    model_type = "qwen2"

    @classmethod
    def dims(cls, config, max_len: int) -> LlamaDims:
        # Qwen2Attention: q/k/v_proj bias=True, o_proj bias=False, whatever attention_bias says
        return LlamaDims.from_config(config, cls.model_type, qkv_bias=True, o_bias=False,
                                     windows=layer_windows(config, cls.model_type, max_len))
