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
