"""What llama-server's and vLLM's users reach for first: the bundle's tokenizer (`specrun
tokenize`, the server's POST /tokenize and /detokenize, held to transformers' tokenizer of the
model the bundle was built from and to the ids a request feeds, Generator.prompt_ids), and a
server that answers to several model names."""

import json

import httpx
import pytest
from click.testing import CliRunner
from helpers import assert_input_error, edit_manifest

import spec_runtime
from draftproof.cli.specrun import main as specrun
from test_serve import assert_error, server

TEXT = "abc, def abc"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def chat_bundle(bundle_copy):
    """The tiny llama bundle with a chat template."""
    edit_manifest(bundle_copy, lambda m: m["tokenizer"].update(chat_template=TEMPLATE))
    return bundle_copy


def _tokenize(*args):
    r = CliRunner().invoke(specrun, ["tokenize", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_specrun_tokenize_is_the_models_own_tokenizer(llama_pair, chat_bundle):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama_pair[0])
    got = _tokenize(TEXT, "--bundle", llama_pair[2])
    assert got["tokens"] == hf(TEXT)["input_ids"]
    assert "".join(got["pieces"]) == hf.decode(got["tokens"])
    bare = _tokenize(TEXT, "--bundle", llama_pair[2], "--no-special")
    assert bare["tokens"] == hf(TEXT, add_special_tokens=False)["input_ids"]
    # --chat: the ids `specrun generate TEXT` feeds, through the chat template
    gen = spec_runtime.load(chat_bundle)
    chat = _tokenize(TEXT, "--bundle", chat_bundle, "--chat")
    assert chat["tokens"] == [int(t) for t in gen.prompt_ids(TEXT)]
    assert chat["tokens"] != got["tokens"]
    lines = CliRunner().invoke(specrun, ["tokenize", TEXT, "--bundle", str(llama_pair[2])])
    assert [int(line.split("\t")[0]) for line in lines.output.splitlines()] == got["tokens"]


def test_specrun_tokenize_refuses_in_one_line(llama_pair, bundle_copy):
    r = CliRunner().invoke(specrun, ["tokenize", "", "--bundle", str(llama_pair[2])])
    assert_input_error(r, "the prompt is empty")
    edit_manifest(bundle_copy, lambda m: m["tokenizer"].update(chat_template=None))
    r = CliRunner().invoke(specrun, ["tokenize", TEXT, "--bundle", str(bundle_copy), "--chat"])
    assert_input_error(r, "no chat template", "--chat")
    with open(bundle_copy / "tokenizer.json", "a") as f:
        f.write(" ")  # a byte more than the manifest's size for it
    r = CliRunner().invoke(specrun, ["tokenize", TEXT, "--bundle", str(bundle_copy)])
    assert_input_error(r, "tokenizer.json")


def test_the_servers_tokenize_and_detokenize_routes(llama_pair, chat_bundle):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama_pair[0])
    gen = spec_runtime.load(chat_bundle)
    messages = [{"role": "user", "content": TEXT}]
    with server(chat_bundle, "--slots", "1") as (url, _):
        for field in ("prompt", "content"):  # vLLM's name, llama-server's
            r = httpx.post(url + "/tokenize", json={field: TEXT})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["tokens"] == hf(TEXT)["input_ids"] and body["count"] == len(body["tokens"])
            assert body["max_model_len"] == gen.capacity()
        r = httpx.post(url + "/tokenize", json={"prompt": TEXT, "add_special_tokens": False})
        assert r.json()["tokens"] == hf(TEXT, add_special_tokens=False)["input_ids"]
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/tokenize", json={"messages": messages, "model": model})
        assert r.json()["tokens"] == [int(t) for t in gen.prompt_ids(messages)]
        ids = hf(TEXT, add_special_tokens=False)["input_ids"]
        r = httpx.post(url + "/detokenize", json={"tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids)}
        assert_error(httpx.post(url + "/tokenize", json={"prompt": TEXT, "messages": messages}),
                     400, "one of them, not 2")
        assert_error(httpx.post(url + "/tokenize", json={}), 400, "not 0")
        assert_error(httpx.post(url + "/detokenize", json={"tokens": [gen.vocab_size]}), 400,
                     f"{gen.vocab_size}", param="tokens")
        assert_error(httpx.post(url + "/detokenize", json={"tokens": "abc"}), 400,
                     param="tokens")
        assert_error(httpx.post(url + "/tokenize", json={"prompt": TEXT, "model": "other"}),
                     404, code="model_not_found")
        metrics = httpx.get(url + "/metrics").text
        assert 'endpoint="/tokenize",status="200"' in metrics


def test_the_tokenizer_routes_are_behind_the_api_key(llama_pair):
    with server(llama_pair[2], "--slots", "1", "--api-key", "s3cret") as (url, _):
        assert_error(httpx.post(url + "/tokenize", json={"prompt": TEXT}), 401)
        r = httpx.post(url + "/tokenize", json={"prompt": TEXT},
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200


def test_a_server_answers_to_every_model_name_it_is_given(llama_pair):
    """--model-name repeated (vLLM's --served-model-name): each name is accepted, /v1/models
    lists them, responses carry the first; any other is a 404 naming them."""
    with server(llama_pair[2], "--slots", "1", "--model-name", "tiny",
                "--model-name", "tiny-alias") as (url, _):
        listed = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert listed == ["tiny", "tiny-alias"]
        for name in listed:
            r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": TEXT,
                                                          "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
        assert_error(httpx.post(url + "/v1/completions", json={"model": "target", "prompt": TEXT}),
                     404, "'tiny', 'tiny-alias'", code="model_not_found")


@pytest.mark.parametrize("names,said", [([""], "'' is not a name"),
                                         (["a", "a"], "a name is given twice")])
def test_bad_model_names_are_refused_before_the_load(names, said, tmp_path):
    args = [a for n in names for a in ("--model-name", n)]
    r = CliRunner().invoke(specrun, ["serve", "--bundle", str(tmp_path / "none"), *args])
    assert_input_error(r, "--model-name", said)
