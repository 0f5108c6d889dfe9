"""The OpenAI API's side of `specrun serve`: request bodies validated as the API's pydantic
models (openai_protocol.py declares them) and made into `Job`s, with what the API itself allows
checked here; the errors, library and pydantic ones alike, in the API's error body (a status,
one line naming the field, and `param`: its path, as messages[0].content); and the responses
and streamed events, made as openai_protocol.py's models. No web framework here (server.py
serves them)."""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ..decode.sampling import SAMPLING_NAMES
from ..errors import CacheCapacityError, FieldError, InputError
from ..request import MAX_TOP_LOGPROBS
from ..tools import HeldText, Toolset, parse_calls
from .openai_protocol import (ABSENT, CONTENT, MAX_COMPLETION_LOGPROBS, ChatChoice, ChatChunkChoice,
                              ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                              ChatLogprobs, ChatMessage, CommonRequest, Completion,
                              CompletionChoice, CompletionChunk, CompletionLogprobs,
                              CompletionRequest, Delta, ErrorInfo, ErrorResponse, FunctionCall,
                              Invalid, NamedTool, TokenLogprob, ToolCall, ToolCallDelta, TopLogprob,
                              Usage, locate)

# what a finished request reports; "cancelled" never reaches a client that is still listening
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}

# -- errors, in the OpenAI API's shape ------------------------------------------------------------

class APIError(Exception):
    """An error the client caused or must handle, as the OpenAI API returns them."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()


# a request field whose name the API spells otherwise
API_NAMES = {"max_new_tokens": "max_tokens"}


def input_error(e: InputError, prompt_field: str = "prompt") -> APIError:
    """The library's message, with the request field it names (FieldError.field, in the API's
    words: the library's max_new_tokens is the API's max_tokens)."""
    if isinstance(e, CacheCapacityError):
        message = str(e).replace("max_new_tokens", "max_tokens")
        return APIError(400, message, param=prompt_field, code="context_length_exceeded")
    if isinstance(e, FieldError):
        param = API_NAMES.get(e.field, e.field)
        return APIError(400, e.in_words(param, "="), param=param, code="invalid_value")
    return APIError(400, str(e), param=None, code="invalid_value")


# -- requests -----------------------------------------------------------------------------------

def validated(model: type[CommonRequest], body: Any) -> CommonRequest:
    """`body` as the request `model` (openai_protocol.py), or the API's 400 naming the first
    field it gets wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_request(model, e.errors(), body) from None


def invalid_request(model, errors: list[dict], body: dict) -> APIError:
    """A pydantic error as one line: the field (its path, as messages[0].content), its value
    and what to send instead. An error of our own (Invalid: a lone surrogate) says why, and is
    the one reported when a union's members fail each in their way."""
    ours = next((e for e in errors if isinstance(e.get("ctx", {}).get("error"), Invalid)), None)
    error = ours or errors[0]
    path, words, value = locate(model, error["loc"], body)
    if ours is not None:
        message = f"{path} {ours['ctx']['error']}"
    elif value is ABSENT:
        message = f"{path} is missing: give {words}"
    else:
        shown = json.dumps(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        message = f"{path} {shown} is invalid: use {words}"
    field = [e["type"] for e in errors if e["loc"][:1] == error["loc"][:1]]
    code = "invalid_type" if ours is None and all(t.endswith("_type") for t in field) else \
        "invalid_value"
    return APIError(400, message, param=path or None, code=code)


@dataclass
class Job:
    """One request as the decode loop needs it, parsed from an OpenAI request body."""

    prompt: Any  # text, token ids, or chat messages
    chat: bool | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    kwargs: dict = field(default_factory=dict)  # GenerationOptions' sampling/γ/draft values
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs
    stop: list[str] = field(default_factory=list)
    default_max_tokens: int | None = None  # max_tokens left out: this, else the context's room
    prompt_field: str = "prompt"  # the request field that holds the prompt
    request: Any = None  # the request.Request made from all this, once, before a slot is taken
    # or, for what is more than one request (a long recording's windows), what the slot runs
    # instead: work(generator, cancel event) -> a result with .text and .stats
    work: Any = None


# the request's fields that GenerationOptions takes as they are (null: its default)
OPTIONS = SAMPLING_NAMES + ("gamma", "use_draft", "response_format")


def check_model(model: str | None, names) -> None:
    """Every route's `model`: one of this server's names (`names`: a name, or several), or
    absent; else OpenAI's 404."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if model is not None and model not in names:
        raise APIError(404, f"The model {model!r} does not exist: this server serves "
                            f"{', '.join(map(repr, names))} (GET /v1/models)", param="model",
                       code="model_not_found")


def parse_common(req: CommonRequest, model_names) -> dict:
    """What the API allows of the fields both routes take (their values' ranges are the
    library's: Server.check), as Job's fields."""
    check_model(req.model, model_names)
    if req.n not in (None, 1):
        raise APIError(400, f"n {req.n} is not supported: use n = 1 (send several requests for "
                            f"several choices)", param="n", code="invalid_value")
    for name, allowed in req.UNSUPPORTED.items():
        if getattr(req, name) not in allowed:
            raise APIError(400, f"{name} is not supported by this server: leave it out",
                           param=name, code="unsupported_parameter")
    newer, max_tokens = req.max_completion_tokens, req.max_tokens
    if newer is not None and max_tokens is not None and max_tokens != newer:
        raise APIError(400, f"max_tokens {max_tokens} and max_completion_tokens {newer} "
                            f"disagree: give one of them", param="max_tokens",
                       code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    return dict(kwargs={name: getattr(req, name) for name in OPTIONS
                        if getattr(req, name) is not None},
                max_tokens=newer if max_tokens is None else max_tokens, stop=stop,
                stream=bool(req.stream),
                include_usage=bool(req.stream_options and req.stream_options.include_usage))


def parse_completion(body: Any, model_names) -> Job:
    req = validated(CompletionRequest, body)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    logprobs = None if req.logprobs is False else req.logprobs
    _in_range("logprobs", logprobs, MAX_COMPLETION_LOGPROBS)
    return Job(prompt=prompt, chat=bool(req.chat), default_max_tokens=16, logprobs=logprobs,
               **parse_common(req, model_names))  # OpenAI's default max_tokens


def message_dicts(messages) -> list[dict]:
    """Request messages as the chat template reads them: {"role", "content"}, a list of text
    parts joined into one string; an assistant's tool_calls and a tool's tool_call_id and
    name kept. A content is missing only beside tool_calls."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None and not m.tool_calls:
            raise APIError(400, f"messages[{i}].content is missing: give {CONTENT} (null only "
                                f"beside an assistant's tool_calls)",
                           param=f"messages[{i}].content", code="invalid_type")
        content = m.content if m.content is None or isinstance(m.content, str) else \
            "".join(p.text for p in m.content)
        extra = {k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name))
                 if v is not None}
        if m.tool_calls:
            extra["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        out.append({"role": m.role, "content": content, **extra})
    return out


def parse_chat(body: Any, model_names) -> Job:
    req = validated(ChatCompletionRequest, body)
    messages = message_dicts(req.messages)
    top = req.top_logprobs
    _in_range("top_logprobs", top, MAX_TOP_LOGPROBS)
    if top and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: set \"logprobs\": true",
                       param="top_logprobs", code="invalid_value")
    job = Job(prompt=messages, chat=True, prompt_field="messages",
              logprobs=(top or 0) if req.logprobs else None, **parse_common(req, model_names))
    given = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice  # "none", "auto", "required", a NamedTool, or None
    try:
        choice = choice.model_dump() if isinstance(choice, NamedTool) else choice
        tools = Toolset.of(given, choice, req.parallel_tool_calls)
    except FieldError as e:
        raise input_error(e) from None
    if tools is not None:
        job.kwargs["tools"] = tools
    return job


def _in_range(name: str, value, high: int) -> None:
    if value is not None and not 0 <= value <= high:
        raise APIError(400, f"{name} {value} is invalid: use an integer in [0, {high}]",
                       param=name, code="invalid_value")


# -- responses ----------------------------------------------------------------------------------

def extension(stats) -> dict:
    """The request's speculative statistics (decode.stats.Counts), as the `draftproof` field
    of a response."""
    return stats.api()


def usage(result) -> Usage:
    """OpenAI's `usage` of a finished request."""
    prompt, completion = result.stats.prompt_tokens, len(result.tokens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


# -- log-probabilities, in the API's two shapes ---------------------------------------------------

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the sampling could not draw (-inf)


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def chat_logprobs(entries, token_text) -> ChatLogprobs:
    """Chat's `logprobs` from the generator's TokenLogprobs; `token_text(id)` is a token's
    text."""
    def one(tok, lp):
        text = token_text(tok)
        return dict(token=text, logprob=_lp(lp), bytes=list(text.encode("utf-8")))

    return ChatLogprobs(content=[TokenLogprob(**one(e.token, e.logprob), top_logprobs=[
        TopLogprob(**one(t, lp)) for t, lp in e.top]) for e in entries])


def completion_logprobs(entries, token_text, offset: int = 0) -> CompletionLogprobs:
    """The legacy completions API's `logprobs`, each token's offset counted from `offset`."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_text(e.token))
        offset += len(tokens[-1])
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[_lp(e.logprob) for e in entries],
        top_logprobs=[{token_text(t): _lp(lp) for t, lp in e.top} for e in entries],
        text_offset=offsets)


def replied_calls(calls: list, reason: str) -> tuple[list[ToolCall], str]:
    """A reply's calls (tools.ToolCall) in the API's shape, each with an id of its own, and its
    finish_reason: "tool_calls" where it ended after them (not cut short by max_tokens)."""
    made = [ToolCall(id="call_" + uuid.uuid4().hex[:24],
                     function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return made, ("tool_calls" if made and reason == "stop" else reason)


def completion_body(result, rid: str, chat: bool, model_name: str,
                    token_text=None, tools=None) -> Completion | ChatCompletion:
    """The response to a request that did not stream; a chat reply's tool calls read from its
    text where the request gave `tools` (a tools.Toolset)."""
    reason = FINISH.get(result.finish_reason, result.finish_reason)
    logprobs = None
    if result.logprobs is not None:
        logprobs = (chat_logprobs if chat else completion_logprobs)(result.logprobs, token_text)
    content, calls = parse_calls(result.text, tools)
    calls, reason = replied_calls(calls, reason)
    choice = ChatChoice(message=ChatMessage(content=content, tool_calls=calls or None),
                        logprobs=logprobs, finish_reason=reason) if chat else \
        CompletionChoice(text=result.text, logprobs=logprobs, finish_reason=reason)
    return (ChatCompletion if chat else Completion)(
        id=rid, created=int(time.time()), model=model_name, choices=[choice],
        usage=usage(result), draftproof=extension(result.stats))


class StreamEvents:
    """The server-sent events of one streamed response, in the API's shapes: a chunk per piece
    of text (with its tokens' logprobs), then the chunk that ends the choice with the stats,
    OpenAI's usage chunk when asked for, and [DONE]; or an error event and [DONE]."""

    def __init__(self, rid: str, chat: bool, model_name: str, job: Job, token_text):
        self.rid, self.chat, self.model_name, self.job = rid, chat, model_name, job
        self.token_text = token_text
        self.Chunk = ChatCompletionChunk if chat else CompletionChunk
        self.created = int(time.time())
        self.offset = 0  # of the next token in the completion's text (the legacy text_offset)
        # a reply that may be tool calls (the request's tools.Toolset): its text is held where
        # a call may begin, with its tokens' logprobs, and the calls are sent at its end
        tools = job.request.options.tools if job.request is not None else None
        self.held = HeldText(tools) if chat and tools is not None else None
        self.held_entries: list = []

    def piece(self, piece: str, entries=None) -> list[str]:
        """The events of one piece of the reply: none while it is held."""
        if self.held is None:
            return [self.chunk(piece, entries=entries)]
        self.held_entries += entries or []
        text = self.held.feed(piece)
        if not text:
            return []
        entries, self.held_entries = self.held_entries, []
        return [self.chunk(text, entries=entries)]

    def _logprobs(self, entries):
        if entries is None or not entries and self.job.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        out = completion_logprobs(entries, self.token_text, self.offset)
        self.offset += sum(len(t) for t in out.tokens)
        return out

    def _event(self, choices: list, **extra) -> str:
        chunk = self.Chunk(id=self.rid, created=self.created, model=self.model_name,
                           choices=choices, **extra)
        return f"data: {chunk.model_dump_json()}\n\n"

    def chunk(self, piece: str | None, reason=None, delta=None, entries=None, **extra) -> str:
        logprobs = self._logprobs(entries)
        if self.chat:
            choice = ChatChunkChoice(delta=delta or Delta(content=piece), logprobs=logprobs,
                                     finish_reason=reason)
        else:
            choice = CompletionChoice(text=piece or "", logprobs=logprobs, finish_reason=reason)
        return self._event([choice], **extra)

    def first(self) -> list[str]:
        """OpenAI's first chat chunk names the role; a completion has none."""
        return [self.chunk(None, delta=Delta(role="assistant", content=""))] if self.chat else []

    def end(self, result, logprobs_sent: int) -> list[str]:
        """The stats ride on the stream's last chunk: OpenAI's usage chunk, when asked for,
        comes last before [DONE] (choices empty), else the chunk that ends the choice."""
        reason = FINISH.get(result.finish_reason, result.finish_reason)
        stats = {"draftproof": extension(result.stats)}
        rest = result.logprobs[logprobs_sent:] if result.logprobs is not None else None
        usage_wanted = self.job.include_usage
        out = []
        if self.held is not None:
            content, calls = self.held.end(result.text)
            rest = self.held_entries + (rest or []) if rest is not None else None
            if content:
                out.append(self.chunk(content, entries=rest))
                rest = [] if rest is not None else None
            calls, reason = replied_calls(calls, reason)
            if calls:
                out.append(self.chunk(None, delta=Delta(tool_calls=[
                    ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)])))
        out.append(self.chunk(None, reason, entries=rest, **({} if usage_wanted else stats)))
        if usage_wanted:
            out.append(self._event([], usage=usage(result), **stats))
        return out + ["data: [DONE]\n\n"]

    @staticmethod
    def error(err: APIError) -> list[str]:
        return [f"data: {json.dumps(err.body())}\n\n", "data: [DONE]\n\n"]


# the name of a model without one (a Generator made without a manifest): clients send it back as
# `model`, which must match
FALLBACK_MODEL_NAME = "draftproof"


def model_names(given, manifest) -> tuple[str, ...]:
    """The names clients may send as `model` (vLLM's --served-model-name): `given`, a name or
    several (the first is the one responses carry), else the bundle's default_model_name;
    InputError for an empty or repeated one."""
    names = (given,) if isinstance(given, str) else tuple(given or ())
    if not names:
        return (default_model_name(manifest),)
    bad = next((n for n in names if not isinstance(n, str) or not n.strip()), None)
    if bad is not None or len(set(names)) < len(names):
        what = f"{bad!r} is not a name" if bad is not None else "a name is given twice"
        raise FieldError("model_name", f"model_name: {what}: give each name once, as "
                                       f"non-empty text")
    return names


def default_model_name(manifest) -> str:
    """The name clients send as `model`: the target's file or repository name."""
    if manifest is None:
        return FALLBACK_MODEL_NAME
    t = manifest.target
    name = t.gguf_file or str(t.source).rstrip("/").split("/")[-1]
    return name.removesuffix(".gguf") or FALLBACK_MODEL_NAME
