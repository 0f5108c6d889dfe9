"""Export-friendly forwards, one file per architecture, chosen by HF `model_type`."""

from __future__ import annotations

from .common import CachedDecoder, UnsupportedModel
from .gemma3 import Gemma3
from .gemma3 import REFUSED as _GEMMA3_REFUSED
from .gpt2 import GPT2
from .llama import Llama
from .mistral import Mistral
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .t5 import T5
from .whisper import Whisper

# HF config.model_type -> decoder class with `from_hf(hf_model, max_len)`
SUPPORTED: dict[str, type[CachedDecoder]] = {
    "llama": Llama, "gpt2": GPT2, "qwen2": Qwen2, "qwen3": Qwen3, "mistral": Mistral,
    "gemma3_text": Gemma3}
# HF config.model_type -> why a near miss of a supported family is refused, and the fix
REFUSED: dict[str, str] = {**_GEMMA3_REFUSED}
# HF config.model_type -> encoder-decoder class with `from_hf(hf_model, max_len, max_source_len)`,
# holding `.encoder` and `.decoder` graphs
ENCODER_DECODER: dict[str, type] = {"t5": T5, "whisper": Whisper}


def _unsupported(model_type) -> UnsupportedModel:
    if model_type in REFUSED:
        return UnsupportedModel(REFUSED[model_type])
    return UnsupportedModel(f"model_type {model_type!r} is not supported for export; supported: "
                      f"{sorted(SUPPORTED)} (decoder-only), {sorted(ENCODER_DECODER)} (encoder-decoder)")


def _check_max_len(max_len: int) -> None:
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")


def for_hf_model(hf_model, max_len: int) -> CachedDecoder:
    """Build the export-friendly float32 forward for a Hugging Face causal LM, with a static
    KV cache of max_len slots. Raises UnsupportedModel for an architecture we do not cover."""
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type in ENCODER_DECODER:
        raise ValueError(f"model_type {model_type!r} is an encoder-decoder: use for_hf_seq2seq")
    if model_type not in SUPPORTED:
        raise _unsupported(model_type)
    _check_max_len(max_len)
    return SUPPORTED[model_type].from_hf(hf_model, max_len)


def for_hf_seq2seq(hf_model, max_len: int, max_source_len: int):
    """Build the encoder and decoder forwards for a Hugging Face encoder-decoder LM: the decoder's
    self-attention cache holds max_len target positions, the encoder reads max_source_len
    (padded) source tokens. Returns a module with `.encoder` and `.decoder`."""
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type in SUPPORTED:
        raise ValueError(f"model_type {model_type!r} is decoder-only: use for_hf_model")
    if model_type not in ENCODER_DECODER:
        raise _unsupported(model_type)
    _check_max_len(max_len)
    return ENCODER_DECODER[model_type].from_hf(hf_model, max_len, max_source_len)


def is_audio(config) -> bool:
    """A speech model: its encoder reads log-mel features (Whisper)."""
    return getattr(ENCODER_DECODER.get(getattr(config, "model_type", None)), "audio", False)


def is_encoder_decoder(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False)) or \
        getattr(config, "model_type", None) in ENCODER_DECODER


__all__ = ["ENCODER_DECODER", "REFUSED", "SUPPORTED", "CachedDecoder", "UnsupportedModel", "GPT2",
           "Gemma3", "Llama", "Mistral", "Qwen2", "Qwen3", "T5", "Whisper", "for_hf_model", "for_hf_seq2seq",
           "is_audio", "is_encoder_decoder"]
