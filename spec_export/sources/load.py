"""Load a Hugging Face causal or encoder-decoder LM and its tokenizer from a hub id, a local
directory, or a GGUF file.

GGUF notes (transformers 5.x, checked with SmolLM2-135M-Instruct.Q4_1.gguf):
- Llama GGUFs go through the legacy loader, which de-quantizes every tensor to `dtype`, yet the
  model stays flagged as quantized (`model.hf_quantizer`, `config.quantization_config =
  GgufConfig(dequantize=False)`), so transformers refuses `.float()` / `.half()` on it. We ask
  for `GgufConfig(dequantize=True)` (the newer loader would otherwise keep some architectures'
  weights packed in GgufLinear blocks, which no float export can read) and then drop the flag.
- llama.cpp stores q_proj / k_proj rows permuted for its interleaved RoPE; transformers undoes
  that permutation on load, so the tensors match an HF checkpoint (parity vs HF cannot see this,
  a garbled generation would).
- the tokenizer comes from the GGUF metadata, chat template included.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch

from spec_runtime.errors import BuildError


def load_hf_model(source: str, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
                  local_files_only: bool = False):
    """-> (model in eval mode, tokenizer).

    `source` is a hub id or a local directory; with `gguf_file` it is the directory (or hub
    repo) holding that GGUF file. A path straight to a .gguf file is accepted too. An
    encoder-decoder config (T5) loads as AutoModelForSeq2SeqLM, anything else as a causal LM.
    `local_files_only` reads a hub id from the local cache only (no network, no retries).
    """
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM,
                              AutoModelForSpeechSeq2Seq, AutoTokenizer)

    if gguf_file is None and str(source).endswith(".gguf") and Path(source).is_file():
        source, gguf_file = str(Path(source).parent), Path(source).name
    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    hub = {"local_files_only": True} if local_files_only else {}
    config = AutoConfig.from_pretrained(source, **gguf, **hub)
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    if getattr(config, "model_type", None) == "whisper":  # speech in, text out
        auto = AutoModelForSpeechSeq2Seq
    if not gguf_file:
        tokenizer = AutoTokenizer.from_pretrained(source, **hub)
        # a mismatch is refused below, with the tensor's name, instead of transformers' report
        # table and a RuntimeError pointing at it
        with _loading_quietly():
            model, info = auto.from_pretrained(source, dtype=dtype, ignore_mismatched_sizes=True,
                                               output_loading_info=True, **hub)
        _refuse_mismatched(info.get("mismatched_keys") or (), "config.json")
        return model.eval(), tokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file, **hub)
    model_kwargs = {"gguf_file": gguf_file, "dtype": dtype, "ignore_mismatched_sizes": True,
                    "output_loading_info": True, **hub}
    try:
        from transformers import GgufConfig  # transformers >= 5

        model_kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    except ImportError:
        pass  # 4.x always de-quantizes GGUF weights
    with _loading_quietly():
        model, info = auto.from_pretrained(source, **model_kwargs)
    _refuse_mismatched(info.get("mismatched_keys") or (), "the GGUF metadata")
    _drop_gguf_quantized_flag(model, f"{source}/{gguf_file}")
    return model.eval(), tokenizer


class ConfigMismatch(ValueError):
    """The config's sizes are not the saved weights' (source.loading_errors names the model)."""


def _refuse_mismatched(mismatched, config: str) -> None:
    """Weights whose shapes are not the ones the config (`config`: where it comes from) makes:
    it was edited, or belongs to another checkpoint."""
    mismatched = sorted(mismatched, key=lambda m: m[0])
    if mismatched:
        name, saved, built = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        fix = ("correct config.json (it must describe the saved weights)"
               if config == "config.json" else "the file is damaged: download it again")
        raise ConfigMismatch(f"{config} does not match the saved weights: {name} is "
                             f"{list(saved)} in the checkpoint and {list(built)} by {config}"
                             f"{more}: {fix}")


class _NoMismatchReport(logging.Filter):
    """transformers' loading report table for weights of another shape: refused in one line
    by _refuse_mismatched instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "MISMATCH" not in str(record.msg)


@contextlib.contextmanager
def _loading_quietly():
    logger, drop = logging.getLogger("transformers.modeling_utils"), _NoMismatchReport()
    logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            # gguf-py's de-quantization of damaged blocks overflows; what comes of it (weights
            # that are not finite) is refused by the parity check, in one line
            warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"gguf\.")
            yield
    finally:
        logger.removeFilter(drop)


def _drop_gguf_quantized_flag(model, where: str) -> None:
    packed = [n for n, t in model.state_dict().items() if not t.dtype.is_floating_point]
    if packed:
        raise BuildError(f"{where}: weights still packed after loading, e.g. {packed[:3]}; cannot export them as float")
    model.hf_quantizer = None  # `is_quantized` is a property over this
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
