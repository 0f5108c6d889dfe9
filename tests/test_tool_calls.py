"""Tool calling (tools.py): the tools rendered as transformers' apply_chat_template renders them,
the model's calls read back (streamed as not), tool_choice "required" and a named function
enforced by the grammar engine, and the whole through the real server and the official openai
client on the default bundle, greedy speculative equal to target-only with tools on."""

import json

import httpx
import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from spec_runtime import InputError
from spec_runtime.chat import chat_prompt
from spec_runtime.errors import FieldError
from spec_runtime.tools import (HeldText, ToolCall, Toolset, call_grammar, grammar,
                                parse_calls)
from test_serve import assert_error, client, server

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# Qwen2.5-Instruct's chat template (the model's own, as its tokenizer_config.json holds it): it
# renders tools, an assistant's tool_calls and the tools' results itself
QWEN = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == "
    "'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are "
    "Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n    "
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
    "\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n"
    "    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>"
    "\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- "
    "'<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}"
    "\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role "
    "== \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n        {%- if "
    "message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n      "
    "  {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is "
    "defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif "
    "%}\n            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}"
    "\n    {%- elif message.role == \"tool\" %}\n        {%- if (loop.index0 == 0) or "
    "(messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}"
    "\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or "
    "(messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n      "
    "  {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- "
    "'<|im_start|>assistant\\n' }}\n{%- endif %}\n")
PLAIN = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TURNS = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]


# -- the calls read back -----------------------------------------------------------------------

def test_calls_are_read_from_what_the_model_wrote():
    tools = Toolset.of(TOOLS)
    call = ToolCall("get_weather", '{"city": "Paris"}')
    assert parse_calls(CALL, tools) == (None, [call])
    assert parse_calls("Let me look.\n" + CALL, tools) == ("Let me look.", [call])
    two = CALL + "\n" + CALL.replace("get_weather", "get_time").replace('"city": "Paris"',
                                                                        '"zone": "UTC"')
    assert parse_calls(two, tools)[1] == [call, ToolCall("get_time", '{"zone": "UTC"}')]
    assert parse_calls(two, Toolset.of(TOOLS, parallel_tool_calls=False))[1] == [call]
    # Llama 3.1's bare form, a coding model's JSON block, arguments sent as text
    assert parse_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}', tools) == \
        (None, [call])
    assert parse_calls('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
                       tools) == (None, [call])
    assert parse_calls(CALL.replace('{"city": "Paris"}', '"{\\"city\\": \\"Paris\\"}"'),
                       tools) == (None, [call])
    # not calls: left as the model wrote them
    for text in (CALL.replace("get_weather", "send_mail"), CALL.replace("}}", "}"),
                 CALL[:30], 'It is {"name": "get_weather", "arguments": {}}', "Sunny."):
        assert parse_calls(text, tools) == (text, [])
    assert parse_calls(CALL, None) == (CALL, [])  # no tools (or tool_choice "none")


PIECES = ["Hi", " ", "\n", "<tool", "_call>", "<", "tool_call>\n", CALL, "{", '"name": ',
          '"get_weather"', ', "arguments": {}}', "```", "json\n", "\n```", "</tool_call>", "x"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=8), st.integers(1, 7))
def test_a_streamed_reply_sends_what_the_whole_reply_reads_as(pieces, size):
    """Streamed in pieces of any size, the content sent as it comes plus what is sent at the end
    is the content parse_calls reads from the whole reply, with the same calls; no piece of a
    call is ever sent as content."""
    text = "".join(pieces)
    tools = Toolset.of(TOOLS)
    held = HeldText(tools)
    sent = "".join(held.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = held.end(text)
    content, expected = parse_calls(text, tools)
    assert (sent + rest, calls) == (content or "", expected)
    if expected:
        assert "<tool_call>" not in sent


def test_tools_and_tool_choice_refused_in_one_line_naming_the_field():
    cases = [
        (dict(tools={"name": "f"}), "tools", "use a list"),
        (dict(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools",
         "'no spaces' is invalid"),
        (dict(tools=TOOLS + TOOLS[:1]), "tools", "'get_weather' is given twice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
         "tools", "not a JSON schema"),
        (dict(tools=TOOLS, tool_choice="always"), "tool_choice", "'always' is invalid"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
         "tool_choice", "'g', which is not among the tools"),
        (dict(tools=None, tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=TOOLS, parallel_tool_calls=1), "parallel_tool_calls", "true or false"),
    ]
    for kwargs, field, words in cases:
        with pytest.raises(FieldError, match=words) as e:
            Toolset.of(kwargs.pop("tools"), **kwargs)
        assert e.value.field == field and str(e.value).startswith(field)
    assert Toolset.of(TOOLS, "none") is None and Toolset.of(None) is None


# -- the tools shown to the model ----------------------------------------------------------------

def test_a_template_that_renders_tools_renders_them_as_transformers_does(llama_pair):
    """The oracle: transformers' apply_chat_template with the same template, tools and turns
    (its calls' arguments as objects, which the API sends as JSON text)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama_pair[0])
    hf_turns = json.loads(json.dumps(TURNS))
    hf_turns[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "celsius"}
    for turns in (ASK, TURNS):
        ours = chat_prompt(QWEN, turns, {}, Toolset.of(TOOLS))
        theirs = hf.apply_chat_template(hf_turns[:len(turns)], tools=TOOLS, chat_template=QWEN,
                                        tokenize=False, add_generation_prompt=True)
        assert ours == theirs
        assert '"name": "get_weather", "description": "The weather in a city"' in ours
    # tool_choice "none": the tools are not shown; the earlier turns still are
    assert chat_prompt(QWEN, TURNS, {}, Toolset.of(TOOLS, "none")) == hf.apply_chat_template(
        hf_turns, chat_template=QWEN, tokenize=False, add_generation_prompt=True)


def test_a_template_without_tools_gets_them_in_a_system_message():
    out = chat_prompt(PLAIN, TURNS, {}, Toolset.of(TOOLS))
    system, user, assistant, tool = out.split("\n<|")[:4]
    assert system.startswith("<|system|># Tools")
    for tool_def in TOOLS:  # each as JSON on its own line, as Qwen's template lists them
        assert "\n" + json.dumps(tool_def) + "\n" in system
    assert user == "user|>" + ASK[0]["content"]
    assert assistant == ('assistant|><tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    assert tool == "user|><tool_response>\n21 degrees, sunny\n</tool_response>"
    given = chat_prompt(PLAIN, [{"role": "system", "content": "Be brief."}] + ASK, {},
                        Toolset.of(TOOLS))
    assert given.startswith("<|system|>Be brief.\n\n# Tools") and given.count("<|system|>") == 1


def test_a_call_that_cannot_be_rendered_is_refused():
    bad = json.loads(json.dumps(TURNS))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(InputError, match="message 1: tool_calls\\[0\\]: the arguments of "
                                         "'get_weather' are not a JSON object"):
        chat_prompt(QWEN, bad, {}, Toolset.of(TOOLS))


# -- the grammar --------------------------------------------------------------------------------

def test_required_calls_are_written_by_the_grammar_with_the_tags_as_the_vocabulary_has_them(
        llama_pair):
    """llguidance (the engine itself) walked along the grammar, for a vocabulary that spells
    the tags out and for one that holds them as tokens of their own (Qwen's): the call starts
    with the tag, holds a call of the named function in its schema, and then only the end can
    follow."""
    llg = pytest.importorskip("llguidance", reason="the grammar extra installs llguidance")
    from tokenizers import AddedToken, Tokenizer

    path = str(llama_pair[2] / "tokenizer.json")
    plain, tagged = Tokenizer.from_file(path), Tokenizer.from_file(path)
    tagged.add_tokens([AddedToken(t, special=True) for t in ("<tool_call>", "</tool_call>")])

    def spelled(text):  # the text's own bytes
        return [i for ch in text for i in plain.encode(ch, add_special_tokens=False).ids]

    def allowed(m, n):
        bits = m.compute_bitmask()
        return [i for i in range(n) if bits[i // 8] >> (i % 8) & 1]

    named = Toolset.of(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                       parallel_tool_calls=False)
    text = spelled('\n{"name": "get_time", "arguments": {"zone": "CET"}}\n')
    eos = 2  # the tiny models' EOS
    for tok, special in ((plain, set()), (tagged, {"<tool_call>", "</tool_call>"})):
        n = tok.get_vocab_size()
        m = llg.LLMatcher(llg.LLTokenizer(tok.to_str(), n_vocab=n, eos_token=[eos]),
                          call_grammar(named, special), log_level=0)
        assert not m.is_error(), m.get_error()
        first = allowed(m, n)
        if special:
            tags = [tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>")]
            assert first == tags[:1]
            body = tags[:1] + text + tags[1:]
        else:
            assert first and all("<tool_call>".startswith(tok.decode([i])) for i in first)
            body = spelled("<tool_call>") + text + spelled("</tool_call>")
        assert m.validate_tokens(body) == len(body)
        m.consume_tokens(body)
        assert allowed(m, n) == [eos]  # one call (parallel_tool_calls false), then the end
        m.rollback(len(text) + 1)
        wrong = spelled('\n{"name": "get_weather"')
        assert m.validate_tokens(wrong) < len(wrong)
    # tool_choice auto with JSON mode: calls, or a JSON object; nothing else
    either = llg.LLMatcher(llg.LLTokenizer(plain.to_str(), n_vocab=plain.get_vocab_size(),
                                           eos_token=[eos]),
                           call_grammar(Toolset.of(TOOLS), set(), {"type": "object"}),
                           log_level=0)
    assert {plain.decode([i]) for i in allowed(either, plain.get_vocab_size())} == {"<", "{"}
    assert grammar({"type": "json_object"}, Toolset.of(TOOLS), lambda _: False)[1] == "tools"
    with pytest.raises(FieldError, match="give one of them") as e:
        grammar({"type": "json_object"}, Toolset.of(TOOLS, "required"), lambda _: False)
    assert e.value.field == "tool_choice"
    assert grammar(None, Toolset.of(TOOLS), lambda _: False) is None  # auto: free text


# -- through the server and the openai client ------------------------------------------------------

@pytest.fixture(scope="module")
def served(default_bundle):
    with server(default_bundle) as (url, _):
        c = client(url, timeout=300)
        yield url, c, c.models.list().data[0].id


def _streamed(c, **kw):
    """A streamed chat reply added up as the openai client's users add it up: (content, {index:
    [name, arguments]}, finish_reason)."""
    content, calls, reason = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, [call.function.name, ""])[1] += \
                call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


@pytest.mark.slow  # builds the real default bundle
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_calls_validate_against_their_schema_streamed_or_not(served, choice):
    _, c, model = served
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60,
              parallel_tool_calls=False)
    reply = c.chat.completions.create(**kw).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    assert reply.message.content is None and len(reply.message.tool_calls) == 1
    call = reply.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    content, calls, reason = _streamed(c, **kw)
    assert (content, reason) == ("", "tool_calls")
    assert calls == {0: [call.function.name, call.function.arguments]}


@pytest.mark.slow  # builds the real default bundle
def test_greedy_speculative_equals_target_only_with_tools_on(served):
    """Both modes, both tool choices: the same reply, content and calls alike."""
    _, c, model = served
    auto = None
    for choice in ("auto", "required"):
        replies = []
        for use_draft in (True, False):
            r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                          tool_choice=choice, max_tokens=30,
                                          extra_body={"use_draft": use_draft})
            message = r.choices[0].message
            replies.append((message.content, [(t.function.name, t.function.arguments)
                                              for t in message.tool_calls or []],
                            r.choices[0].finish_reason, r.usage.completion_tokens))
            assert (r.model_extra["draftproof"]["proposed"] > 0) == use_draft
        assert replies[0] == replies[1]
        auto = auto or replies[0]
    # and streamed, auto: the same reply as the one that was not
    content, calls, reason = _streamed(c, model=model, messages=ASK, tools=TOOLS,
                                       max_tokens=30)
    assert (content or None, [tuple(v) for v in calls.values()], reason) == auto[:3]


@pytest.mark.slow  # builds the real default bundle
def test_a_conversation_with_calls_and_their_results_goes_on(served):
    url, c, model = served
    turns = TURNS + [{"role": "user", "content": "And in Oslo?"}]
    r = c.chat.completions.create(model=model, messages=turns, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt is the conversation with the tools shown: longer than without them
    bare = c.chat.completions.create(model=model, messages=turns, max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 100


@pytest.mark.slow  # builds the real default bundle
def test_tool_requests_a_client_gets_wrong(served):
    url, _, _ = served

    def post(body):
        return httpx.post(url + "/v1/chat/completions", json={"messages": ASK, **body},
                          timeout=60)

    assert_error(post({"tools": TOOLS, "tool_choice": {"type": "function",
                                                       "function": {"name": "nope"}}}),
                 400, "'nope', which is not among the tools", param="tool_choice")
    assert_error(post({"tools": [{"type": "function", "function": {"name": "a b"}}]}), 400,
                 "'a b' is invalid", param="tools")
    assert_error(post({"tools": TOOLS, "tool_choice": "required",
                       "response_format": {"type": "json_object"}}), 400, "give one of them",
                 param="tool_choice")
    assert_error(post({"tools": TOOLS, "tool_choice": "sometimes"}), 400, "tool_choice",
                 param="tool_choice")
    assert_error(post({"tool_choice": "required"}), 400, "needs tools", param="tool_choice")
    bad = json.loads(json.dumps(TURNS))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "not json"
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": bad},
                            timeout=60), 400, "are not a JSON object")
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": [
        {"role": "user"}]}, timeout=60), 400, "messages[0].content is missing",
        param="messages[0].content")
