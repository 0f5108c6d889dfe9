"""The errors draftproof raises for what its user can fix.

`InputError` and its subclasses are bad input: a value, a file, a bundle, a model. Each message
names the value and the fix. The command-line tools turn exactly these into one line on stderr
and exit code 2; any other exception is a bug in draftproof and keeps its traceback. They derive
from ValueError, so code that catches ValueError keeps working.
"""

from __future__ import annotations

import re


class InputError(ValueError):
    """Bad input; the message names the value and the fix."""


class FieldError(InputError):
    """A bad value of one named field of a request (GenerationOptions, SamplingParams). The
    message starts with the field's name as Python spells it (`top_p=2.0 is invalid: ...`,
    `logit_bias[5]=300.0 is invalid: ...`); a front end that names the field otherwise (the
    CLI's --top-p, the OpenAI API's max_tokens) says it in its own words with `in_words`."""

    def __init__(self, field: str, message: str, others: tuple[str, ...] = ()):
        """`others`: the fields the message names past its start (`gamma=9 exceeds
        max_gamma=8`), as field=value or, where the name has an underscore, by the name alone;
        `in_words` renames those too."""
        super().__init__(message)
        self.field = field
        self.others = others

    def in_words(self, name: str, equals: str = " ", words=None) -> str:
        """The message with the field called `name`: "top_p=2.0 is invalid" -> "--top-p 2.0
        is invalid" (`equals` " "), "logit_bias[5]=300.0" -> "--logit-bias 5=300.0"; and each
        of `others` called words(other) where `words` is given."""
        rest = str(self)[len(self.field):]
        for other in self.others if words is not None else ():
            # `name=value` always; a bare name where it cannot be a word (max_len, not draft)
            bare = r"\b" if "_" in other else "(?!)"
            rest = re.sub(rf"\b{other}(=|{bare})",
                          lambda m: words(other) + (equals if m.group(1) else ""), rest)
        if rest.startswith("["):
            key, _, value = rest[1:].partition("]=")
            return f"{name}{equals}{key}={value}"
        if rest.startswith("="):
            return f"{name}{equals}{rest[1:]}"
        return name + rest


class BuildError(InputError):
    """Bad input to `specexport build` (a model, a source, an option, the output directory)."""


class BundleError(InputError):
    """A bundle that cannot be used (missing, damaged, edited, unreadable)."""


class CacheCapacityError(InputError):
    """A request needs more positions than the static KV cache holds."""


class NonFiniteLogitsError(InputError):
    """The graph produced NaN or +inf logits: no token may be drawn from such a distribution
    (a corrupt graph or corrupt inputs)."""


class TemplateError(InputError):
    """The chat template refused the messages (its own raise_exception)."""


def install_extra(extra: str) -> str:
    """The command that installs one of draftproof's extras here: from a checkout (the package's
    directory sits beside its pyproject.toml, as an editable install leaves it) `pip install -e
    "CHECKOUT[extra]"`, else `pip install "draftproof[extra]"`."""
    from pathlib import Path

    checkout = Path(__file__).resolve().parents[1]
    project = checkout / "pyproject.toml"
    try:
        ours = 'name = "draftproof"' in project.read_text(encoding="utf-8")
    except OSError:
        ours = False
    if ours:
        return f'pip install -e "{checkout}[{extra}]"'
    return f'pip install "draftproof[{extra}]"'
