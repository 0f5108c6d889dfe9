"""Export-friendly Qwen3 forward over Hugging Face `Qwen3ForCausalLM` weights.

Llama's block (models/llama.py) with an RMSNorm over each head's q and k before RoPE
(`q_norm`, `k_norm`), an explicit `head_dim` (not hidden_size / heads), `attention_bias` on all
four projections, and Qwen2's sliding-window rule (`layer_types`, only with
`use_sliding_window`).
"""

from __future__ import annotations

from .llama import Llama, LlamaDims, layer_windows


class Qwen3(Llama):
    model_type = "qwen3"

    @classmethod
    def dims(cls, config, max_len: int) -> LlamaDims:
        return LlamaDims.from_config(config, cls.model_type, qk_norm=True,
                                     windows=layer_windows(config, cls.model_type, max_len))
