"""Tool calling, as OpenAI's chat API has it: a request's `tools` (functions, each with a JSON
schema of its parameters) and its `tool_choice`, checked once into a `Toolset`; the tools given
to the model through its chat template; the calls read back out of what it writes.

The model writes a call as the Hermes format that Qwen2.5's and Qwen3's templates teach it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(a template that renders `tools` itself tells the model so; for one that does not,
`tools_system_text` says it in a system message, in the same words). A reply that is one bare
JSON object {"name": ..., "arguments" or "parameters": {...}} naming a given function, alone or
in a ```json code block, is read as a call too (Llama 3.1's templates ask for that form; coding
models write the block).

`tool_choice`:
- "auto" (the default with tools): the model decides; its calls are read from what it wrote,
  and what it wrote otherwise is the reply's content.
- "required", or a function by name: the output is constrained (constraint.py, a grammar for
  llguidance) to one or more calls of the given functions (of the named one), each with
  arguments that the function's parameter schema accepts, so the call is always valid JSON of
  that schema. The mask is the target's and the draft's alike, so speculative decoding stays
  exact: the output is the target's distribution restricted to what the grammar allows.
- "none": the tools are not shown to the model and nothing is read as a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .decode.constraint import grammar_of, schema_of
from .errors import FieldError, InputError

MAX_TOOLS = 128  # functions per request, as OpenAI's API allows
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (and dots, as vLLM)
CHOICES = ("none", "auto", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}}
TOOL_CHOICE_FORM = ('"none", "auto", "required" or {"type": "function", "function": '
                    '{"name": ...}}')


@dataclass(frozen=True)
class Toolset:
    """A request's tools, checked: `tools` as the chat template reads them ({"type":
    "function", "function": {"name", "description", "parameters"}}, each function as given),
    `choice` "auto",
    "required" or a function's name, and whether several calls may come in one reply."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        """A call is required (tool_choice "required" or a function's name): the grammar
        writes it."""
        return self.choice != "auto"

    def schema(self, name: str) -> dict:
        return next(t["function"].get("parameters", NO_PARAMETERS) for t in self.tools
                    if t["function"]["name"] == name)

    @classmethod
    def of(cls, tools, tool_choice=None, parallel_tool_calls=None) -> "Toolset | None":
        """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked (FieldError
        naming the field); None where no tool can be called (none given, or "none")."""
        if isinstance(tools, Toolset):
            if tool_choice is not None or parallel_tool_calls is not None:
                raise TypeError("a Toolset carries its own tool_choice and "
                                "parallel_tool_calls: pass it alone")
            return tools
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise FieldError("parallel_tool_calls", f"parallel_tool_calls="
                                                    f"{parallel_tool_calls!r} is invalid: use "
                                                    f"true or false")
        checked = _checked_tools(tools)
        choice = _checked_choice(tool_choice, tuple(t["function"]["name"] for t in checked))
        if not checked or choice == "none":
            return None
        return cls(checked, choice, parallel_tool_calls is not False)


def _checked_tools(tools) -> tuple[dict, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise FieldError("tools", f"tools: {type(tools).__name__} given: use a list of "
                                  f'{{"type": "function", "function": {{"name": ...}}}}')
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools: {len(tools)} given, more than {MAX_TOOLS}: give at "
                                  f"most {MAX_TOOLS} functions")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools: item {i}"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict):
            raise FieldError("tools", f"{where} is {json.dumps(tool, default=str)[:80]}: use "
                                      f'{{"type": "function", "function": {{"name": ..., '
                                      f'"parameters": {{...}}}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise FieldError("tools", f"{where}: the function name {name!r} is invalid: use "
                                      f"1 to 64 letters, digits, '_', '-' or '.'")
        if name in seen:
            raise FieldError("tools", f"{where}: the function {name!r} is given twice: name "
                                      f"each function once")
        seen.add(name)
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise FieldError("tools", f"{where}: the parameters of {name!r} are not a JSON "
                                      f"schema object: give one, such as {NO_PARAMETERS}")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise FieldError("tools", f"{where}: the description of {name!r} is not text")
        # as given (the template shows the model the function as the client wrote it)
        out.append({"type": "function", "function": dict(function)})
    return tuple(out)


def _checked_choice(choice, names: tuple[str, ...]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise FieldError("tool_choice", f"tool_choice {json.dumps(choice, default=str)[:80]}"
                                            f" is invalid: use {TOOL_CHOICE_FORM}")
        if name not in names:
            given = ", ".join(map(repr, names)) or "none"
            raise FieldError("tool_choice", f"tool_choice names the function {name!r}, which "
                                            f"is not among the tools (given: {given})")
        return name
    if choice not in CHOICES:
        raise FieldError("tool_choice", f"tool_choice={choice!r} is invalid: use "
                                        f"{TOOL_CHOICE_FORM}")
    if choice == "required" and not names:
        raise FieldError("tool_choice", 'tool_choice="required" needs tools: give the '
                                        'functions in tools')
    return choice


# -- the model's side: the tools in its prompt, its calls in its grammar --------------------------

def tools_system_text(toolset: Toolset) -> str:
    """What a chat template that does not render tools is given in a system message: the
    tools and the call format, in the words of Qwen2.5's template."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in toolset.tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def call_grammar(toolset: Toolset, special: set[str], content_schema: dict | None = None
                 ) -> str | None:
    """llguidance's grammar (its lark form) for a reply of tool calls: one (or one or more,
    when parallel calls are allowed) Hermes-format call of a given function (of the named
    one), its arguments in that function's schema, written with the separators the model
    was taught. `special`: the tags the vocabulary holds as tokens of their own (Qwen's), so
    the grammar asks for those tokens, not for their text spelled out. With tool_choice auto
    and a JSON response_format (`content_schema`), the reply is either calls or that JSON;
    None where nothing constrains the reply."""
    if not toolset.forced and content_schema is None:
        return None
    names = toolset.names if toolset.choice in ("auto", "required") else (toolset.choice,)
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                                "arguments": toolset.schema(name)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name in names]
    schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                                        "item_separator": ", "}}
    tag = {t: t if t in special else json.dumps(t) for t in (OPEN, CLOSE)}
    more = ' ("\\n" call)*' if toolset.parallel else ""
    rules = [f"calls: call{more}",
             f'call: {tag[OPEN]} "\\n" body "\\n" {tag[CLOSE]}',
             f"body: %json {json.dumps(schema)}"]
    if toolset.forced:
        return "\n".join(["start: calls"] + rules)
    content = {**content_schema, "x-guidance": {"whitespace_flexible": False}}
    return "\n".join(["start: calls | content"] + rules + [f"content: %json {json.dumps(content)}"])


def grammar(response_format, toolset: Toolset | None, is_token) -> tuple[str, str] | None:
    """(llguidance's grammar, the request field it is made of) for a reply that
    `response_format` and `toolset` constrain; None where nothing does. `is_token(text)`:
    whether the vocabulary holds `text` as one token (a tag the grammar asks for as such)."""
    schema = schema_of(response_format)
    if toolset is None or not toolset.forced and schema is None:
        text = grammar_of(response_format)
        return None if text is None else (text, "response_format")
    if toolset.forced and schema is not None:
        raise FieldError("tool_choice", f"tool_choice={toolset.choice!r} asks for tool calls and "
                                        f"response_format for JSON content: give one of them "
                                        f"(tool_choice \"auto\" lets the model choose)")
    special = {tag for tag in (OPEN, CLOSE) if is_token(tag)}
    return call_grammar(toolset, special, schema), "tools"


# -- the model's output: its calls read back ------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: text


BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
FENCE = "```json"
FENCED = re.compile(r"\s*```json\s*(.*?)\s*```\s*\Z", re.S)  # a reply that is one JSON code block


def _bare(text: str) -> bool:
    """Whether a reply may be one bare call: it begins with a JSON object, or a JSON code
    block (which coding models write)."""
    head = text.lstrip()
    return head.startswith(("{", FENCE)) or bool(head) and FENCE.startswith(head)


def parse_calls(text: str, toolset: Toolset | None) -> tuple[str | None, list[ToolCall]]:
    """(the reply's content, its calls) of what the model wrote. Without calls the content is
    the text as it is; with them, the text around them (None when only whitespace). A block
    that is not a call of a given function (unknown name, arguments that are no JSON object,
    a reply cut short inside it) is left in the content, as the model wrote it."""
    if toolset is None or not text:
        return text, []
    calls, kept, at = [], [], 0
    for match in BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None or call.name not in toolset.names:
            continue
        kept.append(text[at:match.start()])
        calls.append(call)
        at = match.end()
    if not calls:
        fenced = FENCED.match(text)
        bare = _call(fenced.group(1) if fenced else text) if _bare(text) else None
        if bare is None or bare.name not in toolset.names:
            return text, []
        return None, [bare]
    if not toolset.parallel:
        calls = calls[:1]
    content = "".join(kept) + text[at:]
    return (content.rstrip() if content.strip() else None), calls


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments' JSON as a string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HeldText:
    """A streamed reply's content while it may still turn into calls: `feed` takes each new
    piece and gives the text that can be sent now; what could begin a call (the start of a
    `<tool_call>` tag, a reply that begins with `{` or a JSON code block, whitespace that may
    come before a call)
    is held until the reply ends, when `end` reads the whole reply and gives the content
    still to send and the calls, exactly as parse_calls does for a reply that is not
    streamed."""

    def __init__(self, toolset: Toolset):
        self.toolset = toolset
        self.text = ""
        self.sent = 0  # characters of self.text sent as content
        self.stopped = False  # a call may have begun: nothing more is sent before the end

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.stopped:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start < 0:  # the longest end of the text that could begin the tag is held
            start = next((i for i in range(max(self.sent, len(self.text) - len(OPEN) + 1),
                                           len(self.text)) if OPEN.startswith(self.text[i:])),
                         len(self.text))
        else:
            self.stopped = True
        head = self.text[:start]
        if not head.strip():
            return ""  # only whitespace so far: it may come before a call
        if _bare(head):  # perhaps a bare JSON call: held to the end
            self.stopped = head.lstrip().startswith(("{", FENCE))  # else: wait and see
            return ""
        upto = len(head.rstrip())  # whitespace held: it may come before a call
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def end(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the content not sent yet, the calls) once the reply `text` is whole."""
        content, calls = parse_calls(text, self.toolset)
        content = content or ""
        assert content.startswith(text[:self.sent]), "sent content must be the reply's"
        return content[self.sent:], calls


def template_messages(messages: list[dict], native: bool) -> list[dict]:
    """A conversation's messages as a chat template reads them: an assistant's tool_calls with
    their arguments as objects (Hugging Face's templates write them with `tojson`; the API
    sends them as JSON text). For a template that does not render tools (`native` False), the
    calls are written into the assistant's content and a tool's result into a user message,
    in the Hermes form the tools' system text describes."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            calls = [_with_arguments(c, f"message {i}: tool_calls[{j}]")
                     for j, c in enumerate(calls)]
            if native:
                out.append({**m, "tool_calls": calls})
            else:
                text = "\n".join(f"{OPEN}\n" + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False) + f"\n{CLOSE}" for c in calls)
                prose = m.get("content") or ""
                out.append({"role": m["role"], "content": f"{prose}\n{text}" if prose else text})
        elif m.get("role") == "tool" and not native:
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n"
                                                   f"</tool_response>"})
        else:
            out.append(m)
    return out


def _with_arguments(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InputError(f"{where} is {json.dumps(call, default=str)[:80]}: use {{\"id\": ..., "
                         f"\"type\": \"function\", \"function\": {{\"name\": ..., "
                         f"\"arguments\": \"{{...}}\"}}}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise InputError(f"{where}: the arguments of {function['name']!r} are not a JSON "
                         f"object: send them as the call gave them, e.g. '{{\"city\": "
                         f"\"Paris\"}}'")
    return {**call, "function": {**function, "arguments": arguments}}


def as_messages(toolset: Toolset, messages: list[dict]) -> list[dict]:
    """`messages` with the tools' system text, for a template that does not render tools:
    added to the first system message, or as one of its own before the conversation."""
    text = tools_system_text(toolset)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages
