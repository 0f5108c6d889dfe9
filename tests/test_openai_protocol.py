"""The OpenAI API's request models (spec_runtime/apps/openai_protocol.py) without a server: the
sampling controls reach both routes from SamplingParams' declaration, each field's JSON type is
checked strictly and a wrong one is the API's 400 in one line naming the field (its path for a
nested one) and what to send; the responses are the shapes the official openai client reads.
The same errors through a running server are in test_serve.py and test_serve_robustness.py."""

import json

import pytest

pytest.importorskip("pydantic", reason="the serve extra installs pydantic (with FastAPI)")

from spec_runtime.apps.openai_api import APIError, parse_chat, parse_completion  # noqa: E402
from spec_runtime.apps.openai_protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
)
from spec_runtime.decode.sampling import SAMPLING_FIELDS  # noqa: E402
from spec_runtime.decode.stats import GenerationStats  # noqa: E402

HELLO = [{"role": "user", "content": "hello"}]
MODEL = "target"
# a JSON value of each type, and the JSON types a Python type's field takes
VALUES = {"string": "7", "true": True, "integer": 7, "fraction": 0.5, "object": {"7": 1},
          "list": [7]}
TAKES = {float: {"integer", "fraction"}, int: {"integer"}}


def refusal(parse, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, MODEL)
    err = e.value
    assert err.status == 400 and "\n" not in err.message, err.message
    assert "pydantic" not in err.message and "validation error" not in err.message
    return err


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_sampling_control_is_a_field_of_both_requests(model):
    """SamplingParams declares the controls once (SAMPLING_FIELDS); a new one is a request
    field of both routes without editing the API."""
    assert len(SAMPLING_FIELDS) >= 9
    for f in SAMPLING_FIELDS:
        assert f.name in model.model_fields, f.name
        assert model.model_fields[f.name].default is None  # left out: the bundle's default
        assert model.model_fields[f.name].description, f.name  # what a 400 says to send


@pytest.mark.parametrize("f", SAMPLING_FIELDS, ids=lambda f: f.name)
def test_a_sampling_control_takes_its_json_type_and_no_other(f):
    """Each control's JSON type follows its Python one (a float is any JSON number, an int an
    integer and never true, the seed an integer, logit_bias an object of numbers): the right
    type reaches the Job as sent (its range is the library's, checked once, later), any
    other is a 400 naming the field, the value and the type to send."""
    if f.name == "logit_bias":
        good = [{"5": 1}, {"5": -0.5}, {}]
        bad = ["7", True, 7, 0.5, [7], {"5": "x"}, {"5": True}, {"5": None}]
    else:
        kind = float if isinstance(f.default, float) else int  # the seed's default is None
        good = [VALUES[t] for t in TAKES[kind]] + [-3]  # a value out of range is the library's
        bad = [v for t, v in VALUES.items() if t not in TAKES[kind]]
    for value in good:
        job = parse_chat({"messages": HELLO, f.name: value}, MODEL)
        assert job.kwargs[f.name] == value, (f.name, value)
    assert f.name not in parse_chat({"messages": HELLO, f.name: None}, MODEL).kwargs
    for value in bad:
        for parse, body in ((parse_chat, {"messages": HELLO}), (parse_completion,
                                                                {"prompt": "hi"})):
            err = refusal(parse, {**body, f.name: value})
            assert err.param == f.name, err.message
            assert err.message.startswith(f"{f.name} "), err.message
            assert "is invalid: use " in err.message, err.message
    shown = refusal(parse_chat, {"messages": HELLO, f.name: "hot"}).message
    assert shown.startswith(f'{f.name} "hot" is invalid: use '), shown


def test_the_message_names_the_value_and_what_to_send():
    err = refusal(parse_chat, {"messages": HELLO, "temperature": "hot"})
    assert err.message == 'temperature "hot" is invalid: use a number'
    assert err.code == "invalid_type"
    err = refusal(parse_completion, {"prompt": "hi", "gamma": 1.5})
    assert err.message == 'gamma 1.5 is invalid: use an integer or "auto"'
    long = refusal(parse_chat, {"messages": HELLO, "temperature": "x" * 500}).message
    assert len(long) < 200 and "..." in long


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "5 is invalid"),
    ({"messages": HELLO + [{"role": "assistant", "content": "hi"}, {"role": 1, "content": "x"}]},
     "messages[2].role", "1 is invalid"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "is missing"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content", "text only"),
    ({"messages": ["hello"]}, "messages[0]", '"role"'),
    ({"messages": HELLO, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "true or false"),
    ({"messages": HELLO, "logit_bias": {"5": "x"}}, "logit_bias", "number"),
    ({"messages": HELLO, "stop": ["a", 5]}, "stop", "strings"),
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({}, "messages", "is missing"),
])
def test_a_nested_field_is_named_by_its_path(body, param, words):
    """`param` is the field's path through objects and lists (messages[0].content, as the
    message spells it); a dict's keys and a union's members are not fields (logit_bias,
    stop)."""
    err = refusal(parse_chat, body)
    assert err.param == param and err.message.startswith(param + " "), err.message
    assert words in err.message, err.message


def test_json_types_are_strict():
    """A number is no string and true is no 1, wherever the API takes one."""
    for body in ({"max_tokens": "5"}, {"max_tokens": 5.0}, {"max_tokens": True},
                 {"stream": 1}, {"use_draft": "false"}, {"n": 1.0}, {"seed": 1.0},
                 {"logprobs": 1}, {"top_logprobs": True}, {"model": 5}, {"stop": 5}):
        (name,) = body
        assert refusal(parse_chat, {"messages": HELLO, **body}).param == name, body
    assert refusal(parse_completion, {"prompt": [1, True]}).param == "prompt"
    assert refusal(parse_completion, {"prompt": "hi", "chat": 1}).param == "chat"


def test_unknown_fields_are_ignored_and_nulls_are_defaults():
    job = parse_chat({"messages": HELLO, "user": "u", "metadata": {"a": 1}, "store": False,
                      "no_such_field": [1], "n": None, "stream": None, "stop": None,
                      "temperature": None, "max_tokens": None, "use_draft": None}, MODEL)
    assert job.kwargs == {} and job.stop == [] and not job.stream and job.max_tokens is None


def test_what_the_fields_become():
    job = parse_chat({"messages": [{"role": "system", "content": "be brief"}, {
        "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "stop": "x", "gamma": "auto", "use_draft": False,
        "response_format": {"type": "json_object"}, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}, MODEL)
    assert job.prompt == [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"}]
    assert job.max_tokens == 7 and job.stop == ["x"] and job.logprobs == 2 and job.chat
    assert job.kwargs == {"gamma": "auto", "use_draft": False,
                          "response_format": {"type": "json_object"}}
    assert job.stream and job.include_usage and job.prompt_field == "messages"
    for prompt, fed in (("hi", "hi"), (["hi"], "hi"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])):
        job = parse_completion({"prompt": prompt, "logprobs": False}, MODEL)
        assert job.prompt == fed and job.logprobs is None and job.default_max_tokens == 16


def test_the_responses_are_what_the_openai_client_reads():
    """The bodies and chunks the server sends validate as the official client's own types."""
    openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
    from types import SimpleNamespace

    from spec_runtime.apps.openai_api import StreamEvents, completion_body

    entry = SimpleNamespace(token=5, logprob=float("-inf"), top=[(5, -0.25), (6, -2.0)])
    result = SimpleNamespace(finish_reason="eos", text="héllo", tokens=[5], logprobs=[entry],
                             stats=GenerationStats(prompt_tokens=3, mode="speculative"))
    text = lambda t: f"<{t}>"  # noqa: E731
    chat = openai.types.chat.ChatCompletion.model_validate(
        completion_body(result, "chatcmpl-1", True, MODEL, text).model_dump(mode="json"))
    assert chat.choices[0].message.content == "héllo" and chat.usage.total_tokens == 4
    assert chat.choices[0].logprobs.content[0].logprob == -9999.0
    assert chat.model_extra["draftproof"] == result.stats.api()
    assert chat.model_extra["draftproof"]["prompt_tokens"] == 3
    assert "specedge" not in chat.model_extra
    legacy = openai.types.Completion.model_validate(
        completion_body(result, "cmpl-1", False, MODEL, text).model_dump(mode="json"))
    assert legacy.choices[0].logprobs.top_logprobs == [{"<5>": -0.25, "<6>": -2.0}]

    job = parse_chat({"messages": HELLO, "stream": True, "logprobs": True,
                      "stream_options": {"include_usage": True}}, MODEL)
    events = StreamEvents("chatcmpl-2", True, MODEL, job, text)
    sent = events.first() + [events.chunk("hé", entries=[entry])] + events.end(result, 1)
    assert sent[-1] == "data: [DONE]\n\n"
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(json.loads(e[6:]))
              for e in sent[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "usage" not in json.loads(sent[0][6:]) and "role" not in json.loads(sent[1][6:])[
        "choices"][0]["delta"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 1
