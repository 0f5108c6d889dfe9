"""The OpenAI API's side of `specrun serve`: request bodies parsed into `Job`s, and errors and
response bodies in the API's shapes. Plain dicts in and out: no web framework here
(server.py serves them)."""

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import CacheCapacityError, FieldError, InputError
from ..request import MAX_TOP_LOGPROBS
from ..decode.sampling import SAMPLING_NAMES

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
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


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

SAMPLING_FIELDS = SAMPLING_NAMES


def _field(body: dict, name: str, kinds, what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise APIError(400, f"{name} {json.dumps(value)[:80]} is invalid: use {what}",
                       param=name, code="invalid_type")
    return value


NUMBER = (int, float)


def _unicode(text: str, name: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no text can contain."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{name} holds a lone surrogate ({text[e.start]!r} at character "
                            f"{e.start}), which is not text: send valid UTF-16 pairs",
                       param=name, code="invalid_value") from None


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


def parse_common(body: Any, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"The model {model!r} does not exist: this server serves "
                            f"{model_name!r} (GET /v1/models)", param="model",
                       code="model_not_found")
    n = _field(body, "n", (int,), "1 (one choice per request)", 1)
    if n != 1:
        raise APIError(400, f"n {n} is not supported: use n = 1 (send several requests for "
                            f"several choices)", param="n", code="invalid_value")
    unsupported = {"echo": (None, False),
                   "best_of": (None, 1), "suffix": (None,), "tools": (None, []),
                   "functions": (None, []), "tool_choice": (None, "none")}
    for name, allowed in unsupported.items():
        if name in body and body[name] not in allowed:
            raise APIError(400, f"{name} is not supported by this server: leave it out",
                           param=name, code="unsupported_parameter")
    kwargs = {}
    for name in SAMPLING_FIELDS:
        if name == "logit_bias":
            value = _field(body, name, (dict,), "an object {token id: bias}")
            bad = next((k for k in value or () if not (k.isascii() and k.isdigit())), None)
            if bad is not None:
                raise APIError(400, f"logit_bias key {json.dumps(bad)[:40]} is invalid: use "
                                    f"token ids written in decimal digits, as \"42\"",
                               param="logit_bias", code="invalid_value")
        elif name in ("top_k", "seed"):
            value = _field(body, name, (int,), "an integer")
        else:
            value = _field(body, name, NUMBER, "a number")
        if value is not None:
            kwargs[name] = value
    gamma = body.get("gamma")
    if gamma is not None:
        if not (gamma == "auto" or isinstance(gamma, int) and not isinstance(gamma, bool)):
            raise APIError(400, f"gamma {json.dumps(gamma)[:40]} is invalid: use an integer or "
                                f"\"auto\"", param="gamma", code="invalid_type")
        kwargs["gamma"] = gamma
    kwargs["use_draft"] = _field(body, "use_draft", (bool,), "true or false", True)
    # JSON mode / a JSON schema: checked and compiled with the bundle (constraint.py)
    response_format = _field(body, "response_format", (dict,), "an object like {\"type\": "
                             "\"json_object\"}")
    if response_format is not None:
        kwargs["response_format"] = response_format
    newer = _field(body, "max_completion_tokens", (int,), "an integer >= 1")
    max_tokens = _field(body, "max_tokens", (int,), "an integer >= 1", newer)
    if newer is not None and max_tokens != newer:
        raise APIError(400, f"max_tokens {max_tokens} and max_completion_tokens {newer} "
                            f"disagree: give one of them", param="max_tokens",
                       code="invalid_value")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens {max_tokens} is invalid: use an integer >= 1",
                       param="max_tokens", code="invalid_value")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or \
            not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "stop is invalid: use a string or a list of at most 4 non-empty "
                            "strings", param="stop", code="invalid_value")
    for s in stop:
        _unicode(s, "stop")
    stream = _field(body, "stream", (bool,), "true or false", False)
    options = _field(body, "stream_options", (dict,), "an object", {})
    return dict(kwargs=kwargs, max_tokens=max_tokens, stop=stop, stream=stream,
                include_usage=bool(options.get("include_usage")))


def parse_completion(body: Any, model_name: str) -> Job:
    common = parse_common(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise APIError(400, "prompt is invalid: use a string, a list of token ids, or a "
                                "list holding one of those (one prompt per request)",
                           param="prompt", code="invalid_value")
    elif not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt is missing or empty: give the text to continue",
                       param="prompt", code="invalid_value")
    # the completions API continues the text as it is (OpenAI's legacy endpoint); chat=True is
    # the package's extension for a chat model behind a completions client
    chat = _field(body, "chat", (bool,), "true or false", False)
    # the legacy API's logprobs: how many alternatives per token (at most 5), null for none
    logprobs = None if body.get("logprobs") is False else _field(
        body, "logprobs", (int,), f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] or null")
    _in_range("logprobs", logprobs, MAX_COMPLETION_LOGPROBS)
    return Job(prompt=prompt, chat=chat, default_max_tokens=16, logprobs=logprobs,
               **common)  # OpenAI's default max_tokens


def parse_chat(body: Any, model_name: str) -> Job:
    common = parse_common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages is missing or empty: give a list of {\"role\", "
                            "\"content\"} objects", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] is invalid: use {{\"role\": ..., \"content\": "
                                f"...}}", param=f"messages[{i}]", code="invalid_value")
        if not m["role"].strip():
            raise APIError(400, f"messages[{i}].role is empty: use \"system\", \"user\" or "
                                f"\"assistant\"", param=f"messages[{i}].role",
                           code="invalid_value")
        _unicode(m["role"], f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content holds a part that is not text: "
                                    f"this model reads text only", param=f"messages[{i}]",
                               code="invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content is invalid: use a string",
                           param=f"messages[{i}].content", code="invalid_value")
        out.append({"role": m["role"], "content": content})
    # chat's logprobs: a flag, and top_logprobs alternatives per token (at most 20) with it
    wanted = _field(body, "logprobs", (bool,), "true or false", False)
    top = _field(body, "top_logprobs", (int,), f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    _in_range("top_logprobs", top, MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: set \"logprobs\": true",
                       param="top_logprobs", code="invalid_value")
    return Job(prompt=out, chat=True, prompt_field="messages",
               logprobs=(top or 0) if wanted else None, **common)


def _in_range(name: str, value, high: int) -> None:
    if value is not None and not 0 <= value <= high:
        raise APIError(400, f"{name} {value} is invalid: use an integer in [0, {high}]",
                       param=name, code="invalid_value")


# -- responses ----------------------------------------------------------------------------------

STATS_FIELDS = ("mode", "draft_kind", "alpha", "acceptance_rate", "proposed", "accepted",
                "tokens_per_target_call", "target_calls", "draft_calls", "tokens_per_s",
                "predicted_speedup", "new_tokens", "prompt_tokens")


# the fields of a response that carry its statistics: `draftproof`, and `specedge` (the
# project's name before draftproof, which clients read) the same until the next release
EXTENSION_FIELDS = ("draftproof", "specedge")


def extension(stats: dict) -> dict:
    """The request's speculative statistics, as the `draftproof` field of a response."""
    return {k: stats[k] for k in STATS_FIELDS if k in stats}


def extensions(stats: dict) -> dict:
    """The response's statistics fields, each holding `extension(stats)`."""
    ext = extension(stats)
    return {name: dict(ext) for name in EXTENSION_FIELDS}


def usage(result) -> dict:
    """OpenAI's `usage` of a finished request."""
    prompt, completion = result.stats["prompt_tokens"], len(result.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# -- log-probabilities, in the API's two shapes ---------------------------------------------------

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the sampling could not draw (-inf)


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def chat_logprobs(entries, token_text) -> dict:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}, from the
    generator's TokenLogprobs; `token_text(id)` is a token's text."""
    def one(tok, lp):
        text = token_text(tok)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob),
                         "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(entries, token_text, offset: int = 0) -> dict:
    """The legacy completions API's `logprobs`: parallel lists of tokens, their logprobs, the
    top alternatives ({text: logprob}) and each token's offset in the text, from `offset`."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_text(e.token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{token_text(t): _lp(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def completion_body(result, rid: str, chat: bool, model_name: str, token_text=None) -> dict:
    """The response to a request that did not stream."""
    reason = FINISH.get(result.finish_reason, result.finish_reason)
    logprobs = None
    if result.logprobs is not None:
        logprobs = (chat_logprobs if chat else completion_logprobs)(result.logprobs, token_text)
    choice = ({"index": 0, "message": {"role": "assistant", "content": result.text},
               "logprobs": logprobs, "finish_reason": reason} if chat else
              {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model_name, "choices": [choice],
            "usage": usage(result), **extensions(result.stats)}


class StreamEvents:
    """The server-sent events of one streamed response, in the API's shapes: a chunk per piece
    of text (with its tokens' logprobs), then the chunk that ends the choice with the stats,
    OpenAI's usage chunk when asked for, and [DONE]; or an error event and [DONE]."""

    def __init__(self, rid: str, chat: bool, model_name: str, job: Job, token_text):
        self.rid, self.chat, self.model_name, self.job = rid, chat, model_name, job
        self.token_text = token_text
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.offset = 0  # of the next token in the completion's text (the legacy text_offset)

    def _logprobs(self, entries):
        if entries is None or not entries and self.job.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        out = completion_logprobs(entries, self.token_text, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def _event(self, body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def chunk(self, piece: str | None, reason=None, delta=None, entries=None, **extra) -> str:
        if self.chat:
            delta = delta or ({} if piece is None else {"content": piece})
            choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(entries),
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": self._logprobs(entries),
                      "finish_reason": reason}
        return self._event({"id": self.rid, "object": self.object, "created": self.created,
                            "model": self.model_name, "choices": [choice], **extra})

    def first(self) -> list[str]:
        """OpenAI's first chat chunk names the role; a completion has none."""
        return [self.chunk(None, delta={"role": "assistant", "content": ""})] if self.chat else []

    def end(self, result, logprobs_sent: int) -> list[str]:
        """The stats ride on the stream's last chunk: OpenAI's usage chunk, when asked for,
        comes last before [DONE] (choices empty), else the chunk that ends the choice."""
        reason = FINISH.get(result.finish_reason, result.finish_reason)
        stats = extensions(result.stats)
        rest = result.logprobs[logprobs_sent:] if result.logprobs is not None else None
        usage_wanted = self.job.include_usage
        out = [self.chunk(None, reason, entries=rest, **({} if usage_wanted else stats))]
        if usage_wanted:
            body = {"id": self.rid, "object": self.object, "created": self.created,
                    "model": self.model_name, "choices": [], "usage": usage(result), **stats}
            out.append(f"data: {json.dumps(body)}\n\n")
        return out + ["data: [DONE]\n\n"]

    @staticmethod
    def error(err: APIError) -> list[str]:
        return [f"data: {json.dumps(err.body())}\n\n", "data: [DONE]\n\n"]


# the name of a model without one (a Generator made without a manifest): clients send it back as
# `model`, which must match, so it keeps the project's name from before draftproof
FALLBACK_MODEL_NAME = "specedge"


def default_model_name(manifest) -> str:
    """The name clients send as `model`: the target's file or repository name."""
    if manifest is None:
        return FALLBACK_MODEL_NAME
    t = manifest.target
    name = t.gguf_file or str(t.source).rstrip("/").split("/")[-1]
    return name.removesuffix(".gguf") or FALLBACK_MODEL_NAME
