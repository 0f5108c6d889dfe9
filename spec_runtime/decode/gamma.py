"""γ, the draft length of a round: an integer, or AUTO (the runtime chooses each round's:
loop.GammaPolicy). Parsed here, from whatever spells it (Python, the CLI's string, JSON, a
manifest); its range is the bundle's, checked where a request is bound to one
(Generator.request)."""

from __future__ import annotations

import enum
import numbers
from typing import Union


class Auto(str, enum.Enum):
    """γ chosen by the runtime each round. A str, so that JSON (a manifest, a report, an OpenAI
    request) writes and reads it as "auto"."""

    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    __repr__ = __str__


AUTO = Auto.AUTO
Gamma = Union[int, Auto]


def parse_gamma(value, field: str = "gamma") -> Gamma | None:
    """`value` as a Gamma: an integer (a Python or numpy one, or its decimal spelling, as a
    command line gives it) or "auto"; None stays None (the bundle's default). FieldError naming
    `field` for anything else; the range is the bundle's (check_gamma_range)."""
    from ..errors import FieldError

    if value is None or value == "auto":  # Auto.AUTO == "auto": a str enum
        return None if value is None else AUTO
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise FieldError(field, f"{field}={value!r} is invalid: use an integer or 'auto'")


def check_gamma_range(gamma: Gamma, max_gamma: int, field: str = "gamma", default=None) -> Gamma:
    """`gamma` against a bundle's max_gamma: AUTO, or an integer in [1, max_gamma]."""
    from ..errors import FieldError

    if gamma is AUTO or 1 <= gamma <= max_gamma:
        return gamma
    also = f", or leave it out for the bundle's default ({default})" if default is not None else ""
    raise FieldError(field, f"{field}={gamma!r} is invalid: use an integer in [1, {max_gamma}] "
                            f"(the bundle's max_gamma), 'auto'{also}")
