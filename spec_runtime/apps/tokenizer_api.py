"""POST /tokenize and /detokenize: the bundle's tokenizer over HTTP, as vLLM's and
llama-server's servers offer it (what `logit_bias`, which takes ids, needs).

    /tokenize    {"prompt" | "content": text, "add_special_tokens": true}
                 {"messages": [...]}: the ids a chat request with them would feed
              -> {"tokens": [...], "count": n, "max_model_len": the cache's positions}
    /detokenize  {"tokens": [...]} -> {"prompt": text}

No slot is taken: the tokenizer runs on the request's own thread, beside the decoding.
"""

from typing import Any

from ..errors import InputError
from .openai_api import APIError, check_model, message_dicts, validated
from .plumbing import read_json
from .openai_protocol import DetokenizeRequest, TokenizeRequest


def tokenize(gen, body: Any, model_names) -> dict:
    req = validated(TokenizeRequest, body)
    check_model(req.model, model_names)
    given = [name for name in ("prompt", "content", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise APIError(400, "give the text as prompt (or content), or the chat as messages: "
                            f"one of them, not {len(given)}", param=(given or ["prompt"])[-1],
                       code="invalid_value")
    try:
        if req.messages is not None:
            ids = gen.prompt_ids(message_dicts(req.messages), True)
        else:
            ids = gen.tokenize(req.prompt if req.prompt is not None else req.content,
                               add_special_tokens=req.add_special_tokens)
    except InputError as e:
        raise APIError(400, str(e), param=given[0], code="invalid_value") from None
    tokens = [int(t) for t in ids]
    return {"tokens": tokens, "count": len(tokens), "max_model_len": gen.capacity()}


def detokenize(gen, body: Any, model_names) -> dict:
    req = validated(DetokenizeRequest, body)
    check_model(req.model, model_names)
    bad = [t for t in req.tokens if not 0 <= t < gen.vocab_size]
    if bad:
        raise APIError(400, f"tokens holds {bad[0]}, which is not a token id of this model: "
                            f"use ids from 0 to {gen.vocab_size - 1}", param="tokens",
                       code="invalid_value")
    return {"prompt": gen.detokenize(req.tokens) or ""}


def add_routes(app, server) -> None:
    """POST /tokenize and /detokenize on the server's app (server.py's routes). FastAPI reads
    the handler's annotation as the class itself: this module leaves annotations unpostponed."""
    from fastapi import Request

    def route(path: str, answer):
        async def handle(request: Request):
            out = answer(server.gen, await read_json(request), server.model_names)
            server.metrics.requests.labels(path, "200").inc()
            return out
        app.post(path)(handle)

    route("/tokenize", tokenize)
    route("/detokenize", detokenize)
