"""draftproof runtime: exact speculative decoding on exported graphs.

Imports numpy (and, when a bundle is loaded, onnxruntime and tokenizers) only: it never imports
torch or transformers, and does nothing at import time beyond defining names.
"""

from .audio import log_mel, read_audio
from .decode.drafts import DRAFTS, Draft, ModelDraft, NgramDraft
from .decode.gamma import AUTO, Gamma
from .decode.sampling import SamplingParams, accept_drafts, sample, warp
from .decode.stats import expected_speedup, expected_tokens_per_round
from .engines.protocol import Engine
from .errors import BundleError, CacheCapacityError, FieldError, InputError, NonFiniteLogitsError
from .generator import Generator
from .request import GenerationOptions, GenerationResult, Request, TextStream

__all__ = [
    "AUTO",
    "DRAFTS",
    "BundleError",
    "CacheCapacityError",
    "Draft",
    "Engine",
    "FieldError",
    "Gamma",
    "GenerationOptions",
    "GenerationResult",
    "Generator",
    "InputError",
    "ModelDraft",
    "NgramDraft",
    "log_mel",
    "read_audio",
    "NonFiniteLogitsError",
    "Request",
    "SamplingParams",
    "TextStream",
    "accept_drafts",
    "expected_speedup",
    "expected_tokens_per_round",
    "load",
    "sample",
    "warp",
]


def load(bundle_dir=None, device: str = "cpu", **kwargs) -> Generator:
    """Open an exported bundle (see `specexport build`) and return its `Generator`; without
    `bundle_dir`, the default bundle (`$DRAFTPROOF_BUNDLE`, else where `specexport build` writes
    without --out: `specrun where` prints it)."""
    from .loading import load_bundle

    return load_bundle(bundle_dir, device=device, **kwargs)
