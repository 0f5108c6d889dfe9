"""`specrun generate --system`, `--json-object` and `--json-schema`: the CLI's words for a system
message and OpenAI's response_format, each equal to the Python API given the same (messages,
response_format), greedy speculative equal to target-only, and refused in one line before the
bundle loads."""

import json

import jsonschema
import pytest
from helpers import assert_input_error, run

import spec_runtime
from draftproof.cli.specrun import main as specrun

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def _generate(bundle, *args):
    r = run(specrun, "generate", *args, "--bundle", bundle, "--max-new-tokens", 24, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_system_is_a_message_before_the_prompt(llama_pair):
    bundle = llama_pair[2]
    gen = spec_runtime.load(bundle)
    got = _generate(bundle, "hello there", "--system", "be brief")
    want = gen.generate([{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hello there"}], max_new_tokens=24)
    assert got["tokens"] == want.tokens
    assert got["stats"]["prompt_tokens"] == len(gen.prompt_ids(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]))
    assert got["stats"]["prompt_tokens"] > len(gen.prompt_ids("hello there"))


@pytest.mark.parametrize("how", ["inline", "file"])
def test_json_schema_constrains_the_answer_as_response_format_does(llama_pair, tmp_path, how):
    bundle = llama_pair[2]
    gen = spec_runtime.load(bundle)
    schema = json.dumps(SCHEMA)
    if how == "file":
        (tmp_path / "schema.json").write_text(schema)
        schema = str(tmp_path / "schema.json")
    got = _generate(bundle, "an answer:", "--json-schema", schema)
    base = _generate(bundle, "an answer:", "--json-schema", schema, "--no-draft")
    want = gen.generate("an answer:", max_new_tokens=24, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert got["tokens"] == base["tokens"] == want.tokens
    assert got["finish_reason"] == "eos", got
    jsonschema.validate(json.loads(got["text"]), SCHEMA)


def test_json_object_is_openais_json_mode(llama_pair):
    bundle = llama_pair[2]
    gen = spec_runtime.load(bundle)
    got = _generate(bundle, "an object:", "--json-object")
    want = gen.generate("an object:", max_new_tokens=24, response_format={"type": "json_object"})
    free = gen.generate("an object:", max_new_tokens=24)
    assert got["tokens"] == want.tokens != free.tokens
    assert got["text"].startswith("{")


@pytest.mark.parametrize("args,said", [
    (["--system", "s", "--no-chat"], "--system is a message of a conversation"),
    (["--json-object", "--json-schema", "{}"], "give one of them"),
    (["--json-schema", "no-such-schema.json"], "--json-schema 'no-such-schema.json' cannot be read"),
    (["--json-schema", "{not json"], "--json-schema is not JSON"),
    (["--json-schema", "[1]"], "--json-schema is not a JSON object"),
])
def test_refused_in_one_line_before_the_bundle_loads(args, said, tmp_path):
    r = run(specrun, "generate", "hi", *args, "--bundle", tmp_path / "no-bundle")
    assert_input_error(r, said)
    assert "no-bundle" not in r.output  # refused before the bundle was looked for
