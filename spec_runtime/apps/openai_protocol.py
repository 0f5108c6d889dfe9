"""The OpenAI API's shapes as pydantic models, as vLLM's and llama-cpp-python's servers declare
theirs: the request bodies of POST /v1/completions and /v1/chat/completions, and what the
server sends back (responses, stream chunks, the model list, the error body).

Requests are checked here for their JSON types only, strictly (a number is no string, `true`
is no 1); the values' ranges are the library's (GenerationOptions, Generator.request: a
FieldError naming the field), so each value is checked once. What the API itself allows or
refuses (n = 1, the fields this server does not support, the two max_tokens, the logprobs
limits) is openai_api.py's, which makes a Job of a validated request and turns a pydantic error
into the API's error body (`locate`: the field it names and what that field expects, in words:
each field's `description`). Fields this server does not know are ignored.

The sampling controls are not listed here: SamplingFields is made from SamplingParams'
SAMPLING_FIELDS (their JSON types from their Python ones), so a control declared there is a
field of both requests.
"""

import types
import typing
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, \
    create_model, model_serializer

from ..decode.sampling import SAMPLING_FIELDS, SamplingParams
from ..request import MAX_TOP_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_STOP = 4  # stop strings per request, as OpenAI's API allows


class Invalid(ValueError):
    """A value of the right JSON type that is still no value (a lone surrogate): the message
    says why and what to send, after the field's name."""


def _text(s: str) -> str:
    """JSON's \\ud800 escapes decode to lone surrogates, which no text can contain."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Invalid(f"holds a lone surrogate ({s[e.start]!r} at character {e.start}), which "
                      f"is not text: send valid UTF-16 pairs") from None
    return s


Text = Annotated[str, AfterValidator(_text)]


def _kinds(annotation) -> list:
    """The types an annotation allows: unions flattened, Annotated unwrapped, None left out."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _kinds(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [k for a in typing.get_args(annotation) for k in _kinds(a)]
    return [] if annotation is type(None) else [annotation]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# -- the sampling controls, from SamplingParams' declaration ------------------------------------

_SCALARS = {float: (float, "a number", "number"), int: (int, "an integer", "integer")}


def _json_form(hint) -> tuple[Any, str]:
    """A sampling control's Python type as JSON carries it, and that in words: a float is a
    number (an integer is one too), an int an integer, pairs (token id, value) an object of
    them (JSON's keys are strings: the library reads the ids from them)."""
    (kind,) = _kinds(hint)
    if kind in _SCALARS:
        return _SCALARS[kind][:2]
    args = typing.get_args(kind)
    if typing.get_origin(kind) is tuple and args[1:] == (Ellipsis,):
        key, value = typing.get_args(args[0])
        if key is int and value in _SCALARS:
            return dict[str, _SCALARS[value][0]], f"an object {{token id: {_SCALARS[value][2]}}}"
    raise TypeError(f"the sampling control of type {hint} has no JSON form: add it to _json_form")


def _sampling_fields() -> type[_Request]:
    hints = typing.get_type_hints(SamplingParams)
    fields = {}
    for f in SAMPLING_FIELDS:
        kind, words = _json_form(hints[f.name])
        fields[f.name] = (kind | None, Field(None, description=words))
    return create_model("SamplingFields", __base__=_Request, __doc__=(
        "The sampling controls (SamplingParams' SAMPLING_FIELDS), each a field of its JSON "
        "type; null or left out: the bundle's default."), **fields)


SamplingFields = _sampling_fields()


# -- requests -----------------------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool | None = Field(None, description="true or false")


TRUE_OR_FALSE = "true or false"


class CommonRequest(SamplingFields):
    """The fields both routes take: the sampling controls, and these."""

    model: str | None = Field(None, description="the name GET /v1/models gives")
    max_tokens: int | None = Field(None, description="an integer >= 1")
    max_completion_tokens: int | None = Field(None, description="an integer >= 1")
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"a string or a list of at most {MAX_STOP} non-empty strings")
    stream: bool | None = Field(False, description=TRUE_OR_FALSE)
    stream_options: StreamOptions | None = Field(
        None, description='an object like {"include_usage": true}')
    n: int | None = Field(1, description="1 (one choice per request)")
    # JSON mode / a JSON schema: checked and compiled with the bundle (constraint.py)
    response_format: dict[str, Any] | None = Field(
        None, description='an object like {"type": "json_object"}')
    # our extensions beside the sampling controls' own
    gamma: int | Literal["auto"] | None = Field(None, description='an integer or "auto"')
    use_draft: bool | None = Field(None, description=TRUE_OR_FALSE)
    # the API's fields this server does not support: refused unless they ask for nothing
    UNSUPPORTED: ClassVar[dict] = {"echo": (None, False), "best_of": (None, 1),
                                   "suffix": (None,), "functions": (None, []),
                                   "function_call": (None, "none")}
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    functions: Any = None  # the API's deprecated form of tools
    function_call: Any = None


Prompt = Annotated[Text, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]


class CompletionRequest(CommonRequest):
    """POST /v1/completions: OpenAI's legacy API, which continues the text as it is."""

    UNSUPPORTED: ClassVar[dict] = {**CommonRequest.UNSUPPORTED, "tools": (None, []),
                                   "tool_choice": (None, "none")}
    tools: Any = None  # chat completions' (a completion continues text: no calls are read)
    tool_choice: Any = None

    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=1)] = Field(
        description="a string, a list of token ids, or a list holding one of those (one "
                    "prompt per request)")
    # how many alternatives per token (at most 5), null for none
    logprobs: int | Literal[False] | None = Field(
        None, description=f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] or null")
    # the package's extension for a chat model behind a completions client
    chat: bool | None = Field(False, description=TRUE_OR_FALSE)


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class CalledFunction(_Request):
    name: Text = Field(description="the function's name")
    arguments: Text = Field(description="its arguments, a JSON object as text")


class CallMade(_Request):
    """An assistant's earlier call, as the API sent it in its reply."""

    expected: ClassVar[str] = ('an object {"id": ..., "type": "function", "function": '
                               '{"name": ..., "arguments": "{...}"}}')
    id: Text | None = Field(None, description="the call's id")
    type: Literal["function"] = Field("function", description='"function"')
    function: CalledFunction = Field(description='an object {"name": ..., "arguments": ...}')


CONTENT = ('a string, or a list of {"type": "text", "text": ...} parts: this model reads text '
           'only')


class Message(_Request):
    expected: ClassVar[str] = 'an object {"role": ..., "content": ...}'  # a list's item

    role: Annotated[Text, StringConstraints(pattern=r"\S")] = Field(
        description='a role such as "system", "user", "assistant" or "tool"')
    # null only beside an assistant's tool_calls (openai_api.message_dicts checks)
    content: Text | list[TextPart] | None = Field(None, description=CONTENT)
    tool_calls: list[CallMade] | None = Field(None, description="a list of calls, as a "
                                                                "reply gave them")
    tool_call_id: Text | None = Field(None, description="the id of the call this message "
                                                        "answers")
    name: Text | None = Field(None, description="a name")


class FunctionDef(_Request):
    name: Text = Field(description="a name of letters, digits, '_', '-' or '.'")
    description: Text | None = Field(None, description="text")
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema object")
    strict: bool | None = Field(None, description=TRUE_OR_FALSE)


class ToolDef(_Request):
    expected: ClassVar[str] = ('an object {"type": "function", "function": {"name": ..., '
                               '"parameters": {...}}}')
    type: Literal["function"] = Field(description='"function"')
    function: FunctionDef = Field(description='an object {"name": ..., "description": ..., '
                                              '"parameters": {...}}')


class NamedFunction(_Request):
    name: Text = Field(description="the name of one of the tools")


class NamedTool(_Request):
    type: Literal["function"] = Field(description='"function"')
    function: NamedFunction = Field(description='an object {"name": ...}')


class ChatCompletionRequest(CommonRequest):
    """POST /v1/chat/completions: messages through the bundle's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)] = Field(
        description='a non-empty list of {"role": ..., "content": ...} objects')
    # a flag, and top_logprobs alternatives per token (at most 20) with it
    logprobs: bool | None = Field(False, description=TRUE_OR_FALSE)
    top_logprobs: int | None = Field(
        None, description=f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    tools: list[ToolDef] | None = Field(None, description='a list of {"type": "function", '
                                                          '"function": {...}} objects')
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}')
    parallel_tool_calls: bool | None = Field(None, description=TRUE_OR_FALSE)


ABSENT = object()  # the value at a location the body does not have (a missing field)


def locate(model: type[BaseModel], loc: tuple, body) -> tuple[str, str | None, Any]:
    """The request field a pydantic error's location names, as the API spells it (models'
    fields and lists' items: "messages[0].content"; a dict's keys and a union's members stay
    out: "logit_bias"), what that field expects in words, and its value in `body` (ABSENT)."""
    path, words, value, kinds = "", None, body, [model]
    for part in loc:
        if isinstance(part, int):
            kinds = [i for k in kinds if typing.get_origin(k) is list
                     for i in _kinds(typing.get_args(k)[0])]
            if not kinds:
                break
            path += f"[{part}]"
            words = next((k.expected for k in kinds if hasattr(k, "expected")), words)
        else:
            fields = [k.model_fields[part] for k in kinds if isinstance(k, type)
                      and issubclass(k, BaseModel) and part in k.model_fields]
            if not fields:
                break
            path += f".{part}" if path else part
            words, kinds = fields[0].description, _kinds(fields[0].annotation)
        ok = isinstance(value, dict) and part in value or \
            isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        value = value[part] if ok else ABSENT
    return path, words, value


TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


class TokenizeRequest(_Request):
    """POST /tokenize: text (`prompt`, as vLLM names it, or `content`, as llama-server does) or
    chat messages (rendered through the bundle's chat template, as a chat request's prompt is)
    -> its token ids."""

    model: Text | None = None
    prompt: Text | None = None
    content: Text | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = Field(True, description="the tokenizer's own special tokens "
                                                       "(a BOS) around text")


class DetokenizeRequest(_Request):
    """POST /detokenize: token ids -> their text (special tokens skipped, as in responses)."""

    model: Text | None = None
    tokens: list[int]


class TranscriptionForm(BaseModel):
    """POST /v1/audio/transcriptions' fields other than the file, as a multipart form sends
    them: text, from which numbers and booleans are read (lax, unlike the JSON routes); an
    empty field is left out (the default)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the name GET /v1/models gives")
    language: str | None = Field(None, description="a language code such as 'en'")
    response_format: Literal[TRANSCRIPTION_FORMATS] = Field(
        "json", description=", ".join(TRANSCRIPTION_FORMATS))
    timestamp_granularities: list[Literal["segment"]] = Field(
        [], description="'segment' (word timestamps are not made)")
    temperature: float | None = Field(None, description="a number")
    seed: int | None = Field(None, description="an integer")
    gamma: str | None = Field(None, description="an integer or 'auto'")
    use_draft: bool | None = Field(None, description=TRUE_OR_FALSE)
    max_tokens: int | None = Field(None, description="an integer")


# -- responses ----------------------------------------------------------------------------------

class _Sparse(BaseModel):
    """A shape whose fields that are None are left out (not sent as null)."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat's `logprobs`: each token's, with its top alternatives."""

    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions API's `logprobs`: parallel lists of tokens, their logprobs, the
    top alternatives ({text: logprob}) and each token's offset in the text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null where the reply is calls only
    tool_calls: list[ToolCall] | None = None  # left out where there are none

    @model_serializer(mode="wrap")
    def _without_calls(self, handler):
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ToolCallDelta(ToolCall):
    index: int  # of the call in the reply: a client adds up a call's deltas by it


class Delta(_Sparse):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class _Body(BaseModel):
    id: str
    object: str  # each body's own literal
    created: int
    model: str


class Completion(_Body):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    # the request's speculative statistics
    draftproof: dict[str, Any]


class ChatCompletion(_Body):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    draftproof: dict[str, Any]


class CompletionChunk(_Body, _Sparse):
    """A streamed completion's event: its usage (when asked for) and stats on the last."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    draftproof: dict[str, Any] | None = None


class ChatCompletionChunk(_Body, _Sparse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    draftproof: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "draftproof"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo
