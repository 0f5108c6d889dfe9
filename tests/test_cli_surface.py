"""The command lines a new user meets: one way to name a bundle, help for every option, versions,
bad values refused before a bundle loads, JSON lines from --stream --json, `specrun chat`, and
the same chat default in the CLI and the Python API."""

import json
from importlib.metadata import version

import click
import pytest
from click.testing import CliRunner
from helpers import assert_input_error, run

import spec_runtime
from draftproof.cli.specexport import main as specexport
from draftproof.cli.specrun import main as specrun

TOOLS = {"specexport": specexport, "specrun": specrun}
READS_A_BUNDLE = {("specrun", "generate"), ("specrun", "transcribe"), ("specrun", "chat"),
                  ("specrun", "bench"), ("specrun", "tokenize"),
                  ("specrun", "check"), ("specrun", "serve"), ("specexport", "verify"),
                  ("specexport", "engine")}


def commands():
    for name, tool in TOOLS.items():
        for sub, command in tool.commands.items():
            yield name, sub, command


@pytest.mark.parametrize("name", TOOLS)
def test_version_and_a_bare_command_prints_help(name):
    r = CliRunner().invoke(TOOLS[name], ["--version"], prog_name=name)
    assert r.exit_code == 0 and r.stdout == f"{name} {version('draftproof')}\n", r.output
    r = CliRunner().invoke(TOOLS[name], [], prog_name=name)
    assert r.exit_code == 0 and "Usage:" in r.stdout and "Commands:" in r.stdout, r.output


def test_every_option_has_help_with_its_default():
    missing = []
    for name, sub, command in commands():
        for p in command.params:
            if not isinstance(p, click.Option) or p.name == "help":
                continue
            text = p.help or ""
            if not text:
                missing.append(f"{name} {sub} {p.opts[0]}: no help")
            elif not (p.is_flag or p.multiple or p.show_default or "[default" in text):
                missing.append(f"{name} {sub} {p.opts[0]}: no default in {text!r}")
    assert missing == []


def test_every_command_that_reads_a_bundle_takes_it_as_dash_b(llama_pair):
    found = {(name, sub) for name, sub, c in commands()
             if any("--bundle" in p.opts and "-b" in p.opts for p in c.params)}
    assert found == READS_A_BUNDLE
    # generate's argument is PROMPT, transcribe's AUDIO, tokenize's TEXT
    for name, sub in READS_A_BUNDLE - {("specrun", "generate"), ("specrun", "transcribe"),
                                       ("specrun", "tokenize")}:
        r = CliRunner().invoke(TOOLS[name], [sub, str(llama_pair[2])], prog_name=name)
        assert r.exit_code == 2 and f"{name} {sub} --bundle {llama_pair[2]}" in r.output, r.output


@pytest.mark.parametrize("sub", ["generate", "chat", "check"])
@pytest.mark.parametrize("args, words", [
    (["--top-p", "2"], "--top-p 2.0 is invalid"),
    (["--temperature", "-1"], "--temperature -1.0 is invalid"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0 is invalid"),
    (["--min-p", "1.5"], "--min-p 1.5 is invalid"),
])
def test_sampling_values_are_refused_before_the_bundle_loads(sub, args, words, tmp_path):
    """The bundle named does not exist: the message is about the value, so nothing was loaded
    first, and it is in the command line's words, not Python's."""
    extra = ["hi"] if sub == "generate" else []
    r = run(specrun, sub, *extra, "--bundle", tmp_path / "nothing", *args)
    assert_input_error(r, words)
    assert "_" not in r.output.split("is invalid")[0] and "None" not in r.output


def test_presence_and_logit_bias_values_are_named_as_options(tmp_path):
    r = run(specrun, "generate", "hi", "--bundle", tmp_path, "--presence-penalty", "3")
    assert_input_error(r, "--presence-penalty 3.0 is invalid", "[-2, 2]")
    r = run(specrun, "generate", "hi", "--bundle", tmp_path, "--logit-bias", "5=300")
    assert_input_error(r, "--logit-bias 5=300.0 is invalid")
    r = run(specrun, "generate", "hi", "--bundle", tmp_path, "--logit-bias", "five")
    assert_input_error(r, "--logit-bias 'five' is invalid", "TOKEN_ID=BIAS")


@pytest.mark.parametrize("value", ["9" * 5000 + "=1", "x" * 5000 + "=1"])
def test_a_logit_bias_of_thousands_of_characters_is_named_shortened(tmp_path, value):
    """An id past Python's 4,300-digit int() limit is beyond any vocabulary, said as the server
    says it; neither message repeats the 5,000 characters."""
    r = run(specrun, "generate", "hi", "--bundle", tmp_path, "--logit-bias", value)
    words = "beyond any vocabulary" if value[0] == "9" else "TOKEN_ID=BIAS"
    assert_input_error(r, "--logit-bias", words)
    assert len(r.output) < 400, r.output


def test_stream_json_is_one_object_per_piece_then_the_result(llama_pair):
    bundle = llama_pair[2]
    whole = run(specrun, "generate", "hello", "-b", bundle, "--max-new-tokens", 12, "--json")
    r = run(specrun, "generate", "hello", "-b", bundle, "--max-new-tokens", 12, "--json",
            "--stream")
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    *pieces, last = lines
    assert pieces and all(set(p) == {"text"} for p in pieces)
    expected = json.loads(whole.stdout)
    assert last["done"] is True and last["tokens"] == expected["tokens"]
    assert "".join(p["text"] for p in pieces) == last["text"] == expected["text"]


def test_chat_default_is_the_same_in_the_cli_and_the_api(llama_pair, monkeypatch):
    """A text prompt goes through the bundle's chat template in both, unless told otherwise;
    `load()` with no argument opens the default bundle."""
    monkeypatch.setenv("DRAFTPROOF_BUNDLE", str(llama_pair[2]))
    gen = spec_runtime.load()
    assert gen.chat_template
    cli = json.loads(run(specrun, "generate", "hello", "--max-new-tokens", 8, "--json").stdout)
    templated = gen.generate(gen.apply_chat_template("hello"), chat=False, max_new_tokens=8)
    assert gen.generate("hello", max_new_tokens=8).tokens == cli["tokens"] == templated.tokens
    raw = json.loads(run(specrun, "generate", "hello", "--max-new-tokens", 8, "--json",
                         "--no-chat").stdout)
    assert gen.generate("hello", max_new_tokens=8, chat=False).tokens == raw["tokens"]


def test_a_missing_bundle_names_the_command_that_makes_it(tmp_path):
    with pytest.raises(spec_runtime.BundleError, match="specexport build --out") as e:
        spec_runtime.load(tmp_path / "my-bundle")
    assert str(tmp_path / "my-bundle") in str(e.value)


def test_chat_keeps_the_conversation_and_answers_as_generate_does(llama_pair):
    """Each answer is what generate gives for the conversation so far as chat messages
    (greedy), /reset forgets it, /stats prints the totals, and the answers stream to stdout with
    one stats line each on stderr."""
    bundle = llama_pair[2]
    gen = spec_runtime.load(bundle)
    r = run(specrun, "chat", "-b", bundle, "--max-new-tokens", 6,
            input="hello\nhow are you\n/stats\n/reset\nhow are you\n/exit\n")
    assert r.exit_code == 0, r.output

    def answer(messages):
        return gen.generate(messages, max_new_tokens=6).text

    first = answer([{"role": "user", "content": "hello"}])
    second = answer([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "how are you"}])
    fresh = answer([{"role": "user", "content": "how are you"}])
    assert second != fresh  # the history changes the answer, so the test can tell them apart
    assert r.stdout == "".join(a + "\n" for a in (first, second, fresh))
    assert r.stderr.count("tok/s") >= 3 and "2 answer(s)" in r.stderr, r.stderr


def test_bench_shows_progress_when_stderr_is_not_a_terminal(llama_pair, tmp_path):
    prompts = tmp_path / "prompts.txt"  # the built-in prompts do not fit the tiny bundle's cache
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(20)))
    r = run(specrun, "bench", "-b", llama_pair[2], "--max-new-tokens", 4, "--prompts", prompts)
    assert r.exit_code == 0, r.output
    progress = [line for line in r.stderr.splitlines() if line.startswith("bench")]
    assert 2 <= len(progress) <= 12, r.stderr


def test_a_stopped_answer_counts_as_an_answer_and_a_turn(llama_pair):
    """`/stats` after Ctrl-C: an answer stopped early (close() after a piece, or Ctrl-C inside
    a target call) joins the conversation and the totals alike, with what it did so far."""
    from spec_runtime.apps.chat_session import ChatSession

    gen = spec_runtime.load(llama_pair[2])
    gen.eos_token_ids = frozenset()  # a random model may end any answer at once
    session = ChatSession(gen, max_new_tokens=8)
    seen = []
    "".join(session.answer("hi"))
    seen.append(session.last_stats)
    answer = session.answer("so?")
    next(answer)
    answer.close()
    seen.append(session.last_stats)
    forward, calls = gen.target.forward, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(*args)

    gen.target.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        for _ in session.answer("ok"):
            pass
    del gen.target.forward
    seen.append(session.last_stats)
    assert seen[0].finish_reason == "length"
    assert [s.finish_reason for s in seen[1:]] == ["cancelled", "cancelled"]
    assert len({id(s) for s in seen}) == 3 and all(0 < s.new_tokens < 8 for s in seen[1:])
    assert session.totals["answers"] == len(session.turns) == 3
    assert session.totals["tokens"] == sum(s.new_tokens for s in seen)
    line = session.totals_line()
    assert line.startswith("3 answer(s)") and line.endswith("3 turn(s) in the conversation")


def test_generate_stops_at_any_of_its_stop_strings(llama_pair):
    """`--stop` (repeatable): the answer ends before the first of them to appear in the text
    the same generation gives without them (a hand cut of that text is the oracle)."""
    bundle = llama_pair[2]
    full = spec_runtime.load(bundle).generate("abc abc abc", max_new_tokens=24, chat=False).text
    assert len(full) >= 12, full  # the tiny model's greedy text, long enough to cut
    stops = [full[9:11], full[5:7]]
    cut = min(full.find(s) for s in stops)
    r = run(specrun, "generate", "abc abc abc", "-b", bundle, "--no-chat", "--max-new-tokens",
            24, "--stop", stops[0], "--stop", stops[1], "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["text"] == full[:cut] and out["stats"]["finish_reason"] == "stop"
    assert_input_error(run(specrun, "generate", "x", "-b", bundle, "--stop", ""),
                       "--stop", "non-empty")


def test_threads_sets_each_sessions_cpu_threads(llama_pair, monkeypatch):
    loaded = []

    def load(*args, **kwargs):
        from spec_runtime.loading import load_bundle

        loaded.append(load_bundle(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(spec_runtime, "load", load)
    from spec_runtime import limits

    monkeypatch.setattr(limits, "usable_cpus", lambda: 4)  # so that 3 is allowed on any machine
    for threads in (1, 3):
        r = run(specrun, "generate", "hi", "-b", llama_pair[2], "--max-new-tokens", 2,
                "--threads", threads)
        assert r.exit_code == 0, r.output
        options = loaded[-1].target.session.get_session_options()
        assert options.intra_op_num_threads == threads
    assert_input_error(run(specrun, "generate", "hi", "--threads", 0), "--threads", "0")
