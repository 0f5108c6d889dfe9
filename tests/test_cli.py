"""The command-line tools: build and generate on tiny models, and exit code 2 with one clear
line (no traceback) for bad input."""

import json
import shutil

import pytest
from helpers import assert_input_error, run

from draftproof.cli.specexport import main as specexport
from draftproof.cli.specrun import main as specrun


def test_build_then_generate_json(tmp_path):
    from tiny_models import gpt2, save

    t = save(gpt2(5), tmp_path / "t")
    d = save(gpt2(6, hidden=32, layers=1, heads=2), tmp_path / "d")
    out = tmp_path / "bundle"
    r = run(specexport, "build", "--target", t, "--draft", d, "--out", out, "--max-len", 64,
            "--quiet")
    assert r.exit_code == 0, r.output
    assert (out / "manifest.json").is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no leftovers

    r = run(specrun, "generate", "hello", "--bundle", out, "--json", "--max-new-tokens", 12,
            "--no-chat", "--gamma", "auto")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert set(obj) == {"tokens", "text", "finish_reason", "stats"}
    assert obj["finish_reason"] == obj["stats"]["finish_reason"]
    assert obj["stats"]["new_tokens"] == len(obj["tokens"]) and obj["stats"]["mode"] == "speculative"

    r = run(specrun, "generate", "hello", "--bundle", out, "--max-new-tokens", 5, "--no-draft")
    assert r.exit_code == 0 and "target-only" in r.stderr

    r = run(specrun, "generate", "--bundle", out, "--max-new-tokens", 5, "--stream", input="hi")
    assert r.exit_code == 0 and "tok/s" in r.stderr

    r = run(specexport, "verify", "--bundle", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["graphs"]["target/decoder"]["ok"]
    diff = json.loads(r.stdout)["graphs"]["target/decoder"]["max_abs_diff"]
    table = run(specexport, "verify", "-b", out)  # the readable form of the same report
    assert table.exit_code == 0, table.output
    row = next(line for line in table.stdout.splitlines() if line.startswith("target"))
    assert "decoder" in row and "fp32" in row and f"{diff:.3g}" in row and row.endswith("ok")


def test_ngram_bundle_reports_acceptance(llama_pair, tmp_path):
    target_dir = llama_pair[0]
    out = tmp_path / "ngram"
    assert run(specexport, "build", "--target", target_dir, "--out", out, "--max-len", 128,
               "--quiet").exit_code == 0
    r = run(specrun, "generate", "one two three, one two three, one two", "--bundle", out,
            "--json", "--max-new-tokens", 30, "--no-chat")
    s = json.loads(r.stdout)["stats"]
    assert s["draft_kind"] == "ngram" and s["proposed"] > 0
    assert sum(s["accept_histogram"]) == s["rounds"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--temperature", "-1"], ["--temperature -1.0", "use a finite number"]),
        (["--top-p", "0"], ["--top-p 0.0"]),
        (["--top-k", "-2"], ["--top-k -2"]),
        (["--gamma", "fast"], ["--gamma 'fast'"]),
        (["--gamma", "99"], ["--gamma 99"]),
        (["--max-new-tokens", "500"], ["max_len is 96", "--max-len"]),
    ],
)
def test_bad_generate_values_exit_2(llama_pair, args, words):
    r = run(specrun, "generate", "hello", "--bundle", llama_pair[2], *args)
    assert_input_error(r, *words)


def test_prompt_longer_than_max_len_exits_2(llama_pair):
    r = run(specrun, "generate", "x" * 200, "--bundle", llama_pair[2], "--no-chat")
    assert_input_error(r, "max_len is 96")


def test_missing_and_corrupt_bundles_exit_2(llama_pair, tmp_path):
    assert_input_error(run(specrun, "generate", "hi", "--bundle", tmp_path / "none"),
                       "specexport build")
    bad = tmp_path / "bad"
    shutil.copytree(llama_pair[2], bad)
    (bad / "target.onnx").write_bytes(b"\0" * 100)
    assert_input_error(run(specrun, "generate", "hi", "--bundle", bad), "target.onnx", "re-run")


def test_non_utf8_prompt_file_exits_2(llama_pair, tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"caf\xe9")
    assert_input_error(run(specrun, "generate", "--prompt-file", f, "--bundle", llama_pair[2]),
                       "not UTF-8")


def test_unknown_model_family_exits_2(tmp_path):
    from tiny_models import byte_tokenizer
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    d = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=259, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1,
                                     num_attention_heads=2)).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    r = run(specexport, "build", "--target", d, "--out", tmp_path / "b", "--quiet")
    assert_input_error(r, "'gpt_neox'", "llama", "gpt2", "qwen2", "gemma3_text")
    assert not (tmp_path / "b").exists()


def test_mismatched_vocabularies_are_refused(tmp_path):
    from tiny_models import byte_tokenizer, gpt2, save, word_tokenizer

    t = save(gpt2(0), tmp_path / "t", byte_tokenizer())
    d = save(gpt2(1, vocab=300), tmp_path / "d", word_tokenizer(300))
    r = run(specexport, "build", "--target", t, "--draft", d, "--out", tmp_path / "b",
            "--max-len", 64, "--quiet")
    assert_input_error(r, "token id 0")


def test_build_refuses_to_overwrite_a_directory_that_is_not_a_bundle(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = run(specexport, "build", "--target", tmp_path, "--out", tmp_path / "mine")
    assert_input_error(r, "not a draftproof bundle")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_bad_build_values_exit_2(tmp_path):
    assert_input_error(run(specexport, "build", "--gamma", "9", "--max-gamma", "8", "--out",
                           tmp_path / "b"), "--gamma 9")
    assert_input_error(run(specexport, "build", "--gamma", "fast", "--out", tmp_path / "b"),
                       "--gamma 'fast'")
    assert_input_error(run(specexport, "build", "--target", tmp_path / "missing", "--out",
                           tmp_path / "b", "--quiet"),
                       f"--target '{tmp_path / 'missing'}': no such file or directory")
    # a directory that holds no model is named as such, not as a malformed Hugging Face id
    assert_input_error(run(specexport, "build", "--target", tmp_path, "--out", tmp_path / "b",
                           "--quiet"), f"--target {str(tmp_path)!r}: cannot load a model from it")


def test_an_internal_bug_keeps_its_traceback(llama_pair, monkeypatch):
    """Only the package's own InputErrors are bad input (exit 2); a ValueError from a bug deep
    inside (here: the sampler) is not the user's fault and must not be dressed up as one."""
    from spec_runtime.decode import loop

    def broken(*args, **kwargs):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(loop, "accept_drafts_greedy", broken)
    r = run(specrun, "generate", "hello", "--bundle", llama_pair[2], "--max-new-tokens", 5)
    assert r.exit_code == 1 and isinstance(r.exception, ValueError), r.output
    assert "broadcast" in str(r.exception)
    from spec_runtime.errors import InputError

    assert not isinstance(r.exception, InputError)


def test_max_len_defaults_to_the_models_own_position_limit(tmp_path):
    """A GPT-2 with 512 learned positions builds without --max-len (the default cache would be
    2048 slots, which such a model cannot address); a larger --max-len is refused with the
    model's limit named."""
    from tiny_models import gpt2, save

    t = save(gpt2(3), tmp_path / "t")
    out = tmp_path / "b"
    r = run(specexport, "build", "--target", t, "--draft", "ngram", "--out", out, "--quiet")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["max_len"] == 512
    assert_input_error(run(specexport, "build", "--target", t, "--draft", "ngram", "--out",
                           tmp_path / "c", "--max-len", 1024, "--quiet"), "n_positions=512")


# -- names longer than the file system allows -----------------------------------------------


def _too_long(tmp_path):
    """A path under tmp_path with one component a byte longer than its file system allows."""
    import os

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    return tmp_path / ("n" * (limit + 1)), limit


@pytest.mark.parametrize("command", [
    ("specrun", "generate", "-b", "{long}", "hi"), ("specrun", "check", "-b", "{long}"),
    ("specrun", "bench", "-b", "{long}"), ("specrun", "list", "{long}"),
    ("specrun", "list", "{long}/inside"), ("specexport", "build", "--out", "{long}"),
    ("specexport", "build", "--out", "{long}/bundle"), ("specexport", "verify", "-b", "{long}"),
    ("specexport", "build", "--target", "{long}"),
    ("specexport", "build", "--draft-model", "{long}", "--out", "{tmp}/b"),
    ("specrun", "where", "$DRAFTPROOF_BUNDLE"), ("specrun", "list", "$DRAFTPROOF_BUNDLE"),
    ("specrun", "generate", "hi", "$DRAFTPROOF_BUNDLE"), ("specrun", "list", "$XDG_DATA_HOME"),
], ids=lambda c: " ".join(c[:3]))
def test_a_path_component_past_the_name_limit_is_one_line(tmp_path, monkeypatch, command):
    """ENAMETOOLONG names neither the part nor the limit: each entry point says which value,
    and that a component may be at most NAME_MAX bytes (the file system's own, as pathconf
    reports it), in one line with exit code 2 (was: an OSError traceback)."""
    long, limit = _too_long(tmp_path)
    tool, *args = command
    if args[-1].startswith("$"):
        monkeypatch.setenv(args.pop()[1:], str(long))
    args = [a.format(long=long, tmp=tmp_path) for a in args]
    r = run(specrun if tool == "specrun" else specexport, *args)
    assert_input_error(r, str(long), f"{limit + 1} bytes", f"at most {limit} bytes")
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert list(tmp_path.iterdir()) == []


def test_pid_file_past_the_name_limit_is_one_line(tmp_path):
    long, _ = _too_long(tmp_path)
    r = run(specrun, "serve", "-b", tmp_path, "--port", 0, "--pid-file", long)
    assert_input_error(r, str(long), "File name too long")
