"""Export-friendly Gemma 3 text forward over Hugging Face `Gemma3ForCausalLM` weights
(`model_type` "gemma3_text": Gemma 3 270M and 1B, or the language model of a larger one).

Llama's block (models/llama.py), changed where Gemma 3 differs:
- the embedding is multiplied by sqrt(hidden_size), rounded to float32 as HF does;
- every RMSNorm multiplies by (1 + w): the weights are stored as w, and 1 is added at load
  (the same float32 sum HF computes each call);
- "sandwich" norms: besides the norms before attention and MLP (`input_layernorm`,
  `pre_feedforward_layernorm`), their outputs are normalised too (`post_attention_layernorm`,
  `post_feedforward_layernorm`) before joining the residual stream;
- q_norm / k_norm over each head before RoPE; scores scaled by query_pre_attn_scalar^-0.5;
- a GELU (tanh approximation) gated MLP;
- sliding-window layers and global layers interleaved (`config.layer_types`), each kind with
  its own RoPE (`rope_parameters["sliding_attention"]`, the local base 10k, and
  `["full_attention"]`, the global base 1M with any linear scaling of the larger models).

Refused by name: logit soft-capping (attention or final; Gemma 2's, null in Gemma 3 configs),
bidirectional attention (EmbeddingGemma), and the multimodal `gemma3` checkpoint.
"""

from __future__ import annotations

from .common import UnsupportedModel
from .llama import Llama, LlamaDims, layer_windows

# model_type -> why it is refused and what to do instead
REFUSED = {
    "gemma3": "model_type 'gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration: a "
              "vision tower beside the language model), which the export does not take apart; "
              "export a text-only checkpoint (model_type 'gemma3_text', e.g. Gemma 3 270M or 1B), "
              "or save the language model as a Gemma3ForCausalLM first",
}
ROPE_KINDS = ("full_attention", "sliding_attention")


class Gemma3(Llama):
    model_type = "gemma3_text"
    norm_offset = 1.0

    @classmethod
    def dims(cls, config, max_len: int) -> LlamaDims:
        family = cls.model_type
        act = getattr(config, "hidden_activation", None)
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModel(f"{family}: hidden_activation={act!r} not supported (only "
                                   f"'gelu_pytorch_tanh')")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise UnsupportedModel(f"{family}: {name}={getattr(config, name)} not supported "
                                       f"(the graphs have no soft-capping of logits)")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModel(f"{family}: use_bidirectional_attention=True (an embedding "
                                   f"model) not supported: the graphs decode causally")
        windows = layer_windows(config, family, max_len)  # refuses other layer types
        kinds = cls._kinds(config)
        return LlamaDims.from_config(
            config, family, act="gelu_tanh", qk_norm=True, sandwich_norms=True,
            embed_scale=config.hidden_size**0.5, attn_scale=config.query_pre_attn_scalar**-0.5,
            windows=windows, rope_of_layer=tuple(kinds.index(t) for t in _types(config)))

    @classmethod
    def rope_sets(cls, config) -> list[tuple[str, dict]]:
        rp = getattr(config, "rope_parameters", None) or {}
        kinds = cls._kinds(config)
        if not all(isinstance(rp.get(k), dict) for k in kinds):
            raise UnsupportedModel(f"{cls.model_type}: rope_parameters has no entry per layer type "
                                   f"({list(kinds)}); load the checkpoint with transformers 5")
        # HF's Gemma3RotaryEmbedding keeps `{layer_type}_inv_freq` for each type in use
        return [(f"{k}_", dict(rp[k])) for k in kinds]

    @staticmethod
    def _kinds(config) -> tuple[str, ...]:
        """The RoPE tables in use: one per layer type present, in ROPE_KINDS order."""
        return tuple(k for k in ROPE_KINDS if k in _types(config))


def _types(config) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
