"""Chat templates, rendered the way Hugging Face tokenizers render them (sandboxed jinja2, the
same globals and filters), with bounds: a bundle's template is code from an untrusted file.
The bounds live in chat_sandbox.py (the environment) and chat_limits.py (how
much); in short:

- jinja2's immutable sandbox stops attribute escapes and mutation of the messages;
- every value that could be large is bounded before it is made, `~` and the output of blocks
  and macros included;
- a render has a budget of work: the characters its operations make or walk, in all (which
  bounds its peak memory however many values it keeps), and its steps (loop iterations and
  calls), which bounds nested loops by count; the clock is a backstop checked at each step;
- the output is streamed and stops at the limit.

No trace function: debuggers and coverage keep theirs while a template renders.

A template that breaks any of this, or fails on the messages (syntax, an undefined name, a
sandbox violation), is a bundle error; one that calls `raise_exception` refuses the messages
(a TemplateError: the user's input). `compile_chat_template` checks a template when the bundle
loads, by rendering a one-message conversation.
"""

from __future__ import annotations

from functools import lru_cache

from .chat_limits import MAX_CHARS, MAX_STEPS, STEPS_PER_MESSAGE, Budget, Limit, rendering
from .chat_sandbox import environment
from .errors import BundleError, InputError, TemplateError
from .bundle.manifest import REBUILD
from .tools import as_messages, template_messages

FIX = f"{REBUILD} from a model whose chat template works"


@lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """Compile and test-render `template`; BundleError if it cannot serve a conversation."""
    from jinja2 import TemplateError as JinjaError

    try:
        compiled = environment().from_string(template)
    except (JinjaError, Limit, RecursionError, MemoryError) as e:
        raise BundleError(f"the bundle's chat template does not compile ({_describe(e)}); "
                          f"{FIX}") from None
    try:
        _render(compiled, [{"role": "user", "content": "Hello"}], {})
    except TemplateError as e:
        raise BundleError(f"the bundle's chat template refuses a one-message conversation "
                          f"({e}); {FIX}") from None
    return compiled


def chat_prompt(template: str, messages, special_tokens: dict, tools=None) -> str:
    """`template` rendered for a user message (text) or a list of {"role", "content"}
    messages, their text checked first: a chat request's prompt (Generator.apply_chat_template,
    `specrun tokenize --chat`). `tools` (a tools.Toolset) are rendered by the template where it
    renders tools (Qwen's, Llama 3.1's), else described in a system message; an assistant's
    earlier `tool_calls` and the `tool` messages with their results are given to it likewise
    (tools.template_messages)."""
    from .text import check_text

    if isinstance(messages, str):
        check_text(messages, "the prompt")
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)):
        raise InputError(f"messages is a {type(messages).__name__}: give a string or a list "
                         f"of {{'role', 'content'}} dicts")
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            check_text(m["content"], f"message {i}")
    return render_chat(template, list(messages), special_tokens, tools)


def render_chat(template: str, messages: list[dict], special_tokens: dict, tools=None) -> str:
    for i, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not (isinstance(m.get("content"), str) or calls and m["content"] is None):
            raise InputError(f"message {i} is {m!r}: each message needs a 'role' and a "
                             f"'content', both strings (an assistant's tool_calls may come "
                             f"with a null content)")
    native = renders_tools(template)
    if tools is not None or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        messages = template_messages(messages, native)
        if tools is not None and not native:
            messages = as_messages(tools, messages)
    return _render(compile_chat_template(template), messages, special_tokens,
                   list(tools.tools) if tools is not None and native else None)


@lru_cache(maxsize=8)
def renders_tools(template: str) -> bool:
    """Whether `template` reads a `tools` variable (renders the tools itself), as Hugging
    Face's apply_chat_template would give it."""
    from jinja2 import TemplateError as JinjaError, meta

    try:
        return "tools" in meta.find_undeclared_variables(environment().parse(template))
    except (JinjaError, RecursionError, MemoryError):
        return False  # compile_chat_template says what is wrong with it


def _render(compiled, messages: list[dict], special_tokens: dict, tools=None) -> str:
    size = sum(len(m["role"]) + len(m["content"] or "") + len(str(m.get("tool_calls") or ""))
               for m in messages) + len(str(tools or ""))
    budget = Budget(MAX_CHARS + 2 * size,
                    MAX_STEPS + STEPS_PER_MESSAGE * (len(messages) + len(tools or ())))
    context = dict(messages=messages, add_generation_prompt=True,
                   **({"tools": tools} if tools is not None else {}),
                   bos_token=special_tokens.get("bos_token", ""),
                   eos_token=special_tokens.get("eos_token", ""))
    pieces, n = [], 0
    try:
        with rendering(budget):
            for piece in compiled.generate(**context):
                n += len(piece)
                if n > budget.limit:
                    raise Limit(f"its output passed {budget.limit} characters")
                if piece:  # empty ones would grow the list with nothing to show for it
                    pieces.append(piece)
    except TemplateError:
        raise
    except Exception as e:  # the template's own code failed: syntax is checked, so this is
        # an undefined name, a sandbox violation, a bound, or any error of its expressions
        raise BundleError(f"the bundle's chat template failed ({_describe(e)}); {FIX}") \
            from None
    return "".join(pieces)


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    if isinstance(e, Limit):
        return text[0]
    line = getattr(e, "lineno", None)
    where = f"line {line}: " if line else ""
    return f"{where}{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")
