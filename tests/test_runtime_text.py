"""Text handling of the generator (stop strings, streaming, chat template) and the promise that
`spec_runtime` runs where torch and transformers are absent."""

import subprocess
import sys
import textwrap

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from toy_models import ToyEngine

from spec_runtime import Generator, ModelDraft

WORDS = ["<eos>", "red", "green", "blue", "sky", "sea"]


def word_tokenizer():
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return tok


def make(**kw):
    target = ToyEngine(vocab=len(WORDS), seed=0)
    draft = ModelDraft(ToyEngine(vocab=len(WORDS), seed=1, like=target, mix=0.5))
    return Generator(target, draft, tokenizer=word_tokenizer(), **kw)


def test_text_is_the_decoded_tokens():
    r = make().generate("red green blue", max_new_tokens=12, temperature=1.0, seed=4)
    assert r.text == " ".join(WORDS[t] for t in r.tokens)


def test_stream_concatenates_to_the_generated_text():
    gen = make()
    pieces = list(gen.stream("red green", max_new_tokens=20, temperature=1.0, seed=9))
    assert len(pieces) > 1
    assert "".join(pieces) == gen.generate("red green", max_new_tokens=20, temperature=1.0,
                                           seed=9).text


def test_stop_string_cuts_text_and_tokens():
    gen = make()
    free = gen.generate("red green", max_new_tokens=30, temperature=1.0, seed=2)
    word = WORDS[free.tokens[5]]
    first = [WORDS[t] for t in free.tokens].index(word)
    r = gen.generate("red green", max_new_tokens=30, temperature=1.0, seed=2, stop=[word])
    assert r.finish_reason == "stop"
    assert r.tokens == free.tokens[: first + 1]
    assert word not in r.text and free.text.startswith(r.text)
    streamed = "".join(gen.stream("red green", max_new_tokens=30, temperature=1.0, seed=2,
                                  stop=[word]))
    assert streamed == r.text


def test_chat_template_is_rendered_with_jinja():
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    gen = make(chat_template=template)
    assert gen.apply_chat_template("hi") == "<user>hi<assistant>"
    with pytest.raises(ValueError, match="no chat template"):
        make().apply_chat_template("hi")


def test_runtime_imports_and_decodes_with_torch_and_transformers_blocked(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        for name in ("torch", "transformers", "optimum", "onnx"):
            sys.modules[name] = None  # any import of them now raises ImportError
        import importlib, pkgutil
        import numpy as np
        import spec_runtime
        for mod in pkgutil.iter_modules(spec_runtime.__path__):
            importlib.import_module("spec_runtime." + mod.name)
        sys.path.insert(0, sys.argv[1])
        from toy_models import ToyEngine
        t = ToyEngine(seed=0)
        gen = spec_runtime.Generator(t, spec_runtime.ModelDraft(ToyEngine(seed=1, like=t, mix=0.5)))
        print(gen.generate([1, 2, 3], max_new_tokens=8, temperature=1.0, seed=0).tokens)
        leaked = [m for m in ("torch", "transformers") if sys.modules.get(m) is not None]
        assert not leaked, leaked
        """
    )
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", script, tests_dir], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert len(eval(out.stdout)) == 8


def test_stream_and_generate_agree_on_tokens_and_stats_after_a_stop():
    """Both end at the token that completes the stop string, and count only up to it."""
    gen = make()
    free = gen.generate("red green", max_new_tokens=30, temperature=1.0, seed=2)
    word = WORDS[free.tokens[5]]
    r = gen.generate("red green", max_new_tokens=30, temperature=1.0, seed=2, stop=word)
    stream = gen.stream("red green", max_new_tokens=30, temperature=1.0, seed=2, stop=word)
    text = "".join(stream)
    streamed = stream.result.stats
    assert text == r.text
    timing = {"wall_time_s", "prefill_time_s", "target_time_s", "draft_time_s",
              "draft_step_time_s", "tokens_per_s", "c", "row_cost", "loop_overhead",
              "predicted_speedup"}
    assert {k: v for k, v in streamed.to_json().items() if k not in timing} == \
        {k: v for k, v in r.stats.to_json().items() if k not in timing}
    assert streamed.new_tokens == len(r.tokens) < len(free.tokens)
    assert streamed.finish_reason == r.finish_reason == "stop"
    assert r.language is None and stream.result.language is None  # text has none


def test_text_is_decoded_incrementally_and_adds_up_to_the_whole():
    """Byte-level tokens of multi-byte characters (é, 😀) arrive one at a time: the pieces add up
    to the decoded sequence, and while the text is valid no decode call sees more than a few
    tokens, however long it grows (the whole text is not decoded again every round); arbitrary
    bytes after it still add up to what a decode of the whole sequence gives."""
    import numpy as np

    from spec_runtime.text import IncrementalText
    from tiny_models import byte_tokenizer

    tok = byte_tokenizer().backend_tokenizer
    text = "Un café ☕ et 😀 — " * 12
    ids = tok.encode(text).ids
    widths = []

    def detokenize(tokens):
        widths.append(len(tokens))
        return tok.decode(tokens, skip_special_tokens=True)

    rng = np.random.default_rng(0)
    tokens = list(ids) + rng.integers(3, 259, 40).tolist()  # and then some arbitrary bytes
    inc = IncrementalText(detokenize)
    pieces = []
    for i, t in enumerate(tokens):
        before = len(inc.text)
        inc.add(t)
        pieces.append(inc.text[before:])
        if i < len(ids):  # valid UTF-8 so far: never half a character, always a small window
            assert "\ufffd" not in inc.text and max(widths) <= 8
    whole = inc.finish()
    assert whole == tok.decode(tokens, skip_special_tokens=True)
    assert whole.startswith("".join(pieces)) and "".join(pieces).startswith(text)
    assert len(ids) > 200
