"""What a bundle says about its models, beside their engines and tokenizer: the settings a
Generator decodes by, in one record. `ModelSettings.of(manifest)` reads them from a bundle's
manifest (loading.py); a Generator made by hand (tests, a toy engine) takes them as keywords.
A Generator holds each as its attribute of the same name (generator.py: plain attributes,
read on every request), and gives them back as one record (`Generator.settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

from .decode.gamma import Gamma, parse_gamma
from .decode.sampling import check_sampling
from .decode.drafts import draft_engines
from .decode.stats import UNMEASURED_DRAFT_STEP, Costs


@dataclass(frozen=True)
class ModelSettings:
    eos_token_ids: Sequence[int] = frozenset()  # the ids that end a generation
    default_gamma: Gamma = 4  # a request's γ when it gives none (AUTO: chosen each round)
    max_gamma: int = 8  # the largest γ the graphs verify in one call
    chat_template: str | None = None  # jinja2, as the model's tokenizer_config has it
    special_tokens: dict = field(default_factory=dict)  # bos_token, eos_token: the template's
    encoder_decoder: bool = False  # T5, Whisper: a source encoded once, a decoder prompted
    decoder_start_token_id: int | None = None  # an encoder-decoder's first decoder token
    # the model's own sampling defaults (the manifest's `generation`): what a request that
    # leaves a sampling control unset (None) gets, before SamplingParams' own defaults
    generation_defaults: dict = field(default_factory=dict)
    audio: object = None  # a speech bundle's manifest.AudioEntry (Whisper)
    # auto γ's prices for seeded sampling, measured at build; None: what is known without
    # measuring (unmeasured_costs)
    costs: Costs | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "eos_token_ids", frozenset(int(t) for t in self.eos_token_ids))
        set_(self, "default_gamma", parse_gamma(self.default_gamma, "default_gamma"))
        set_(self, "special_tokens", dict(self.special_tokens or {}))
        set_(self, "generation_defaults", check_sampling(dict(self.generation_defaults or {})))

    @classmethod
    def of(cls, manifest) -> "ModelSettings":
        """A bundle's settings, from its (checked) manifest.Manifest."""
        tok = manifest.tokenizer
        return cls(eos_token_ids=tok.eos_token_ids, default_gamma=manifest.default_gamma,
                   max_gamma=manifest.max_gamma, chat_template=tok.chat_template,
                   special_tokens=tok.special_tokens, encoder_decoder=manifest.encoder_decoder,
                   decoder_start_token_id=manifest.decoder_start_token_id,
                   generation_defaults=manifest.generation, audio=manifest.audio,
                   costs=Costs(**manifest.costs) if manifest.costs else None)


SETTINGS = tuple(f.name for f in fields(ModelSettings))


def unmeasured_costs(draft) -> Costs:
    """Auto γ's prices where none were measured: a draft without engines (prompt lookup) steps
    for free, a hybrid's model at its draft_cost, any other model at UNMEASURED_DRAFT_STEP;
    verified rows at the paper's price, nothing."""
    if draft is None or not draft_engines(draft):
        return Costs(0.0)
    return Costs(float(getattr(draft, "draft_cost", UNMEASURED_DRAFT_STEP)))
