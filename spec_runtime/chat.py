"""Chat templates, rendered the way Hugging Face tokenizers render them (sandboxed jinja2)."""

from __future__ import annotations

from functools import lru_cache


class TemplateError(ValueError):
    pass


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(f"chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], special_tokens: dict) -> str:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} is {m!r}: each message needs 'role' and 'content'")
    return _compile(template).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=special_tokens.get("bos_token", ""),
        eos_token=special_tokens.get("eos_token", ""),
    )
