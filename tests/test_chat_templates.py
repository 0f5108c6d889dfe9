"""Chat templates are code from an untrusted file: real templates render exactly as Hugging Face
renders them (the oracle: transformers' own chat-template environment), while a template that
tries to grow a value, keep many of them, or loop without end is refused in one line before the
memory or the time is spent, by counting, not by the clock, and without a trace function (a
debugger's or coverage's keeps working while a template renders)."""

import json
import subprocess
import sys
import textwrap

import pytest

from spec_runtime.chat import render_chat
from spec_runtime.chat_limits import MAX_STEPS, STEPS_PER_MESSAGE, WORK_FACTOR
from spec_runtime.errors import BundleError, TemplateError

SMOLLM2 = (  # HuggingFaceTB/SmolLM2-135M-Instruct, the default bundle's model
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA31 = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}")
# the features of jinja2 the bounds touch, in one template: macros and caller, a recursive
# loop, block assignment, filters that grow, slices, literals, tojson with an indent, `%`
FEATURES = """{% macro turn(m, n) -%}
[{{ n }}:{{ m.role|upper }}] {{ caller() if caller else '' }}{{ m.content|wordwrap(20)|indent(2) }}
{%- endmacro %}
{%- set ns = namespace(total=0, roles=[]) %}
{%- for m in messages %}{% set ns.total = ns.total + m.content|length %}{% set ns.roles = ns.roles + [m.role] %}{% endfor %}
{%- set header %}{{ ns.roles|join(', ') }} / {{ '%05d' % ns.total }} / {{ messages[-2:]|map(attribute='role')|list }}{% endset %}
{{- header|center(60) }}
{%- for m in messages %}{% call turn(m, loop.index) %}({{ loop.revindex }}{{ '~' ~ loop.length }}){% endcall %}
{% endfor %}
{%- for x in [[1, [2, [3]]], 4] recursive %}<{{ x if x is number else loop(x) }}>{% endfor %}
{{ messages|tojson(indent=2) }}{{ (messages|first).content[::-1] }}{{ {'k': (1, 2)}|tojson }}
{{ ('ab' * 3)|replace('b', 'cd') }}{{ "{} and {}".format(ns.total, ns.roles|length) }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Say hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n"
                                           "</think>\n\n4"},
     {"role": "user", "content": "Und auf Deutsch? \"vier\" — é, 😀, <b>&</b>"}],
]


def hugging_face(template, messages, special):
    """The oracle: transformers' own chat-template environment, as apply_chat_template uses it."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).render(messages=messages,
                                                    add_generation_prompt=True, **special)


SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("template", ["SMOLLM2", "LLAMA3", "LLAMA31", "QWEN3", "MISTRAL",
                                      "GEMMA", "FEATURES"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_real_templates_render_as_hugging_face_renders_them(template, conversation):
    source, messages = globals()[template], CONVERSATIONS[conversation]
    from jinja2 import TemplateError as JinjaError

    try:
        expected = hugging_face(source, messages, SPECIAL)
    except JinjaError as e:  # the template's own raise_exception: the same refusal here
        with pytest.raises(TemplateError, match="refused the messages") as err:
            render_chat(source, messages, SPECIAL)
        assert str(e) in str(err.value)
        return
    assert render_chat(source, messages, SPECIAL) == expected


def test_templates_refuse_what_their_authors_refuse():
    """The comparison above would pass vacuously if no template raised: some do."""
    with pytest.raises(TemplateError, match="System role not supported"):
        render_chat(GEMMA, CONVERSATIONS[1], SPECIAL)
    with pytest.raises(TemplateError, match="must alternate"):
        render_chat(MISTRAL, CONVERSATIONS[1], SPECIAL)


def two_messages_bomb(body: str) -> str:
    """A template that serves one message (so that it loads) and runs `body` on two."""
    return ("{% if messages|length > 1 %}" + body + "{% endif %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}")


TWO = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

MEASURE = textwrap.dedent("""
    import json, os, resource, sys, tracemalloc
    from spec_runtime.chat import compile_chat_template, render_chat
    template, messages = json.loads(sys.stdin.read())
    compile_chat_template(template)  # compiled (and rendered once) before the measurement
    import spec_runtime.chat_limits as limits
    limits.RENDER_SECONDS = 1e6  # refused by a bound, not by the clock, however fast or slow
    # 1 GiB more address space than the imports took (the old way peaked at 3 GB)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), used + (1 << 30)))
    tracemalloc.start()
    try:
        render_chat(template, messages, {})
        message = "rendered"
    except Exception as e:
        message = f"{type(e).__name__}: {e}"
    print(json.dumps([tracemalloc.get_traced_memory()[1], message]))
""")


def render_measured(template, messages=TWO) -> tuple[int, str]:
    """(peak bytes the render allocated, its outcome), in a process of its own that may take
    1 GiB more address space than its imports did, so that a bound that fails ends as a
    MemoryError, not as the test machine's memory."""
    out = subprocess.run([sys.executable, "-c", MEASURE], input=json.dumps([template, messages]),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peak, message = json.loads(out.stdout)
    return peak, message


MIB = 1 << 20


@pytest.mark.parametrize("body, words", [
    # 3,000 copies of a million characters joined by `~`: 3 GB had it been built
    ("{% set a = 'x' * 1000000 %}{{ " + " ~ ".join(["a"] * 3000) + " }}",
     ["'~' would make 3000000000 characters"]),
    ("{{ 'ab' * 1000000000 }}", ["'*' would make 2000000000 characters"]),
    ("{% set a = 'x' * 1000000 %}{{ ([a] * 1000)|length }}", ["'*' would make"]),
    ("{{ ([[]] * 100000000)|length }}", ["'*' would make"]),
    ("{% set a = 'x' * 1000000 %}{% set b %}{% for i in range(1000) %}{{ a }}{% endfor %}"
     "{% endset %}", ["a block's output passed"]),
])
def test_a_value_is_refused_before_it_is_built(body, words):
    """Peak memory of the render: under 8 MiB (the largest value it may make is 1 MiB of
    text; the refused one would be gigabytes)."""
    peak, message = render_measured(two_messages_bomb(body))
    assert message.startswith("BundleError: the bundle's chat template failed ("), message
    for w in words:
        assert w in message, message
    assert "\n" not in message and "specexport build" in message, message
    assert peak < 8 * MIB, (peak, message)


@pytest.mark.parametrize("body, words", [
    # a range or a generator, joined: 100000 items, each with a separator of 40000 characters
    ("{{ range(100000)|join('y' * 40000) }}", ["the filter 'join' would make more than"]),
    ("{{ range(100000)|map('string')|join('y' * 40000) }}",
     ["the filter 'join' would make more than"]),
    ("{{ ('y' * 10000).join(range(100000)|map('string')) }}", ["join() would make more than"]),
    # widths and precisions of any number of digits, nested ones filled in, many fields
    ("{{ '{0:>{1}}'.format('x', '999999999') }}", ["a {}-format would make more than"]),
    ("{{ '{0:{1}{2}}'.format('x', '>', '999999999') }}", ["a {}-format would make more than"]),
    ("{{ '{0:>{1}}'['format']('x', '999999999') }}", ["a {}-format would make more than"]),
    ("{{ ('{0:>999999}' * 1000).format(1) }}", ["a {}-format would make more than"]),
    ("{{ ('{:.999999f}' * 1000).format(*((1.5,) * 1000)) }}",
     ["a {}-format would make more than"]),
    ("{{ ('%999999d' * 1000) % ((1,) * 1000) }}", ["a %-format would make 1000016000 "]),
    ("{{ ('%(a)999999d' * 1000) % {'a': 1} }}", ["a %-format would make"]),
    ("{{ ('%-*d' * 1000) % ((999999, 1) * 1000) }}", ["a %-format would make"]),
    ("{{ ('%999999d' * 1000)|format(*((1,) * 1000)) }}", ["the filter 'format' would make"]),
    # a generator's items kept by a filter or by *args: 100000 of 2000 characters
    ("{{ (range(100000)|map('string')|map('replace', '', 'y' * 1000)|list)|length }}",
     ["the items drawn by the filter 'list' would make more than"]),
    ("{{ ('{}' * 2).format(*(range(100000)|map('string')|map('replace', '', 'y' * 1000))) }}",
     ["the items drawn by '*' unpacking would make more than"]),
    # replace writes a list with str() first: 104000 matches of 1000 characters
    ("{{ (['a' * 100] * 1000)|replace('', 'y' * 1000) }}", ["replace would make"]),
    # bytes are sequences too
    ("{{ ('x'.encode() * 1000000000)|length }}", ["'*' would make 1000000000 characters"]),
    # a width or a separator repeated per line or per item: indent breaks lines at '\x0b' too
    ("{{ ('a\\x0b' * 100000)|indent('y' * 4000) }}", ["the filter 'indent' would make"]),
    ("{{ ([1] * 4000)|tojson(separators=('y' * 40000, ':')) }}",
     ["the filter 'tojson' would make"]),
    # pprint indents a dict's items by the length of its key: 4000 lines of 5000 spaces
    ("{{ {'k' * 5000: [''] * 4000}|pprint|length }}", ["the filter 'pprint' would make"]),
])
def test_a_value_made_of_many_pieces_is_refused_as_it_is_made(body, words):
    """Each piece (an item, a separator, a field) is counted as it is made, and the total is
    refused as soon as it would pass the limit on one value: no count of pieces is estimated
    (a generator's cannot be). Peak memory of the render: under 8 MiB (these would make from
    150 MB to gigabytes)."""
    peak, message = render_measured(two_messages_bomb(body))
    assert message.startswith("BundleError: the bundle's chat template failed ("), message
    for w in words:
        assert w in message, message
    assert "\n" not in message and "specexport build" in message, message
    assert peak < 8 * MIB, (peak, message)


# what the bounded operations make, compared with jinja2's own sandbox making it unbounded
SAME_AS_JINJA2 = [
    "{{ messages|map(attribute='content')|join(', ') }}{{ messages|join('|', attribute='role') }}",
    "{{ [1, 'x', none, [2, 'y'], {'k': 'v'}]|join('-') }}",
    "{% autoescape true %}{{ ['<a>', 'b'|safe]|join('&') }}"
    "{{ messages|map(attribute='content')|join('<br>') }}{% endautoescape %}",
    "{{ '-'.join(messages|map(attribute='role')) }}{{ '-'.encode().join(['a'.encode()] * 2) }}",
    "{{ '{0:>{1}}|{2!r}|{x:.3f}|{0:*^9}|{3:,}|{3:_b}'.format('ab', 6, 'q', 123456, x=3.14159) }}",
    "{{ '{a} {b[0]}'.format_map({'a': 1, 'b': [2]}) }}",
    "{{ '%05d|%-6s|%.2f|%x|%r|%c|%%|%*d|%.*f' % (42, 'ab', 3.14159, 255, 'q', 65, 5, 7, 2, 1.5) }}",
    "{{ '%(a)s-%(b)05.1f' % {'a': 'x', 'b': 2.25} }}{{ '%s and %s'|format('a', 'b') }}"
    "{{ '%(x)s'|format(x=1) }}{{ 12|format }}",
    "{{ 'ab'.center(9, '*') }}{{ 'ab'.ljust(5) }}|{{ '7'.zfill(4) }}{{ 'ab'|center(8) }}|",
    "{{ messages[0].content|indent(3, true) }}{{ messages[1].content|wordwrap(2) }}",
    "{{ messages|tojson(indent=2) }}{{ {'a': [1, 2]}|tojson(separators=(',', ':')) }}",
    "{{ messages|pprint }}{{ messages|string }}{{ {'a': 'b c'}|urlencode }}{{ 'a.com'|urlize }}",
    "{{ range(7)|batch(3, 0)|list }}{{ range(7)|slice(3)|list }}{{ range(10)|select('odd')|sum }}",
    "{% for x in range(4)|reverse %}{{ loop.index }}{{ x }}{% endfor %}"
    "{{ range(3)|map('string')|unique|list }}{{ messages|groupby('role')|list|length }}",
    "{% macro m(a, b) %}{{ a }}{{ b }}{{ varargs }}{% endmacro %}{{ m(*(range(4)|map('string'))) }}",
]


@pytest.mark.parametrize("body", SAME_AS_JINJA2)
def test_bounded_operations_make_what_jinja2_makes(body):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from spec_runtime.chat_sandbox import _tojson

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[loopcontrols])
    plain.filters["tojson"] = _tojson
    messages = [{"role": "user", "content": "a<b>&'\"c"},
                {"role": "assistant", "content": "d\te\x0bf"}]
    template = two_messages_bomb(body)
    assert render_chat(template, messages, {}) == plain.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token="", eos_token="")


def test_values_kept_in_many_variables_stay_within_the_render_s_work():
    """Each value is small enough, but 300 of them are kept at once (300 MB in all): the
    render's work in all is bounded, so its peak is too: WORK_FACTOR (64) times the 1 MiB
    value limit, and some room for the interpreter's own."""
    body = "{% set a = 'x' * 1000000 %}" + "".join(
        f"{{% set a{i} = a ~ '{i}' %}}" for i in range(300))
    peak, message = render_measured(two_messages_bomb(body))
    assert "characters a render may make in all" in message, message
    assert peak < (WORK_FACTOR + 8) * MIB, (peak, message)


def test_nested_loops_are_refused_by_their_count_not_the_clock(monkeypatch):
    """10**10 iterations: refused after MAX_STEPS (+ STEPS_PER_MESSAGE per message) loop
    iterations and calls whatever the machine's speed (the clock is pushed out of reach);
    a loop within that count renders."""
    import spec_runtime.chat_limits as limits

    monkeypatch.setattr(limits, "RENDER_SECONDS", 1e6)
    steps = MAX_STEPS + STEPS_PER_MESSAGE * len(TWO)
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(BundleError, match=f"more than {steps} loop iterations and calls"):
        render_chat(two_messages_bomb(nested), TWO, {})
    filtered = ("{% for i in range(100000) %}{% for j in range(100000) if false %}{% endfor %}"
                "{% endfor %}")  # the items a loop's filter drops count too
    with pytest.raises(BundleError, match="loop iterations and calls"):
        render_chat(two_messages_bomb(filtered), TWO, {})
    recursive = ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                 "{% endmacro %}{{ f(40) }}")  # 2**40 calls, no loop at all
    with pytest.raises(BundleError, match="loop iterations and calls"):
        render_chat(two_messages_bomb(recursive), TWO, {})
    within = "{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
    assert render_chat(two_messages_bomb(within), TWO, {}) == "ab"


def test_a_render_leaves_a_debugger_s_or_coverage_s_tracer_alone():
    """The tracer installed here sees the template's own frames while it renders."""
    seen = []

    def tracer(frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            seen.append(event)
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        text = render_chat(SMOLLM2, CONVERSATIONS[0], {})
        during = sys.gettrace()
    finally:
        sys.settrace(previous)
    assert during is tracer and "Hello" in text
    assert "call" in seen, "the render replaced the tracer"
