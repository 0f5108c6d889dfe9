"""Greedy parity with Hugging Face on real checkpoints of the new families: Gemma 3 270M and
Qwen2.5-Coder 0.5B / 1.5B (Q4_K_M GGUF files, benchmarks/real_models.py; the float model both
sides run is transformers' de-quantization of the file).

Each model is built at fp32 with prompt lookup as the draft (`specexport build --draft ngram`,
in a subprocess, so that the build's memory is given back before HF loads the model again), then
on each prompt (the chat template applied by HF's tokenizer where the model has one) the bundle's
greedy tokens, target-only and speculative, are compared with HF `generate`. Gemma's long prompt
crosses its 512-key sliding window. The graph differs from PyTorch by ~1e-4 in the logits, so a
position where HF's two best tokens are closer than TIE may go either way: the test then stops
comparing there and says so. Every row of the longest prompt, in one prefill, is also held to
the build's logit tolerance, and where a sliding window binds, a window one key wider or
narrower is shown to leave HF's logits on those rows. Slow: minutes and gigabytes per model
(transformers de-quantizes every tensor), so it runs only when selected with `-m slow`.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
TIE = 1e-3  # the build's fp32 parity tolerance on a logit
CODE = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
PROMPTS = [
    "Write a Python function that returns the n-th prime number.",
    f"Rename the function fib to fibonacci in this code and add a docstring:\n\n{CODE}",
    "Explain in two sentences what a hash map is.",
]
# past Gemma 3's sliding window of 512 keys: ~560 tokens with its tokenizer
LONG = "Continue the list.\n" + "".join(f"{i}. item number {i} of the long list\n"
                                        for i in range(1, 46))
MODELS = {"gemma3-270m": (768, PROMPTS[::2] + [LONG]), "qwen-0.5b": (256, PROMPTS),
          "qwen-1.5b": (256, PROMPTS)}


def real_models():
    spec = importlib.util.spec_from_file_location(
        "real_models", Path(__file__).parents[1] / "benchmarks" / "real_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def prompt_ids(tok, prompt: str) -> list[int]:
    if tok.chat_template:
        return list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    return tok(prompt)["input_ids"]


def compare(hf, ids: list[int], ours: list[int], ref: list[int], what: str) -> int:
    """How many tokens agree; fails at a difference unless HF's top two were within TIE there."""
    same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    if same < len(ref):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + ref[:same]])).logits[0, -1].float()
        margin = float(logits[ref[same]] - logits[ours[same]])
        print(f"{what}: differs at token {same} (HF {ref[same]}, ours {ours[same]}), HF's "
              f"margin {margin:.2g}")
        assert margin < TIE, f"{what}: token {same} differs and HF's margin is {margin:.3g}"
    return same


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_equals_hf_on_real_weights(name, tmp_path, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("builds a real model for minutes and gigabytes: runs when asked for, "
                    "`pytest -m slow tests/test_real_families.py`")
    path = real_models().cached(name)
    if path is None:
        pytest.skip(f"{name} is not cached: `python benchmarks/real_models.py {name}` fetches it")
    max_len, prompts = MODELS[name]
    bundle = tmp_path / "bundle"
    build = subprocess.run(
        [sys.executable, "-c", "from draftproof.cli.specexport import main; main()", "build",
         "--target", str(path), "--draft", "ngram", "--max-len", str(max_len), "--out",
         str(bundle), "--quiet"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    print(build.stdout)

    import spec_runtime
    from spec_export.sources.load import load_hf_model
    from spec_export.parity.calls import open_decoder
    from draftproof.models import for_hf_model
    from tiny_models import window_shifted

    hf, tok = load_hf_model(str(path))
    # every row of the longest prompt in one prefill (Gemma's crosses its sliding window)
    ids = prompt_ids(tok, max(prompts, key=len))
    with torch.no_grad():
        want = hf(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    got = open_decoder(bundle / "target.onnx").forward(np.asarray(ids, np.int64), 0, len(ids))
    diff = float(np.abs(got - want).max())
    print(f"{name}: max |Δlogit| over the {len(ids)} rows of the longest prompt: {diff:.3g}")
    assert diff < TIE
    for shift in (1, -1):  # where the window binds, an off-by-one leaves HF's logits
        module = window_shifted(for_hf_model(hf, max_len), shift)
        if not any(layer.window for layer in module.layers):
            break
        past = [torch.zeros(module.cache_shape()) for _ in range(2 * module.n_layers)]
        with torch.no_grad():
            off = module(torch.tensor([ids]), torch.tensor(0), torch.tensor(len(ids)), *past)[0]
        off = float(np.abs(off[0].numpy() - want).max())
        print(f"{name}: a window {shift:+d} key wide differs from HF by {off:.3g}")
        assert off > 10 * TIE
    del module
    gen = spec_runtime.load(bundle)
    gen.eos_token_ids = frozenset()  # compare NEW_TOKENS tokens, past an end of turn too
    assert gen.target.graph.kernels == "fused"
    for prompt in prompts:
        ids = prompt_ids(tok, prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              repetition_penalty=1.0, eos_token_id=None, pad_token_id=0)
        ref = out[0, len(ids):].tolist()
        for use_draft in (False, True):
            r = gen.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0,
                             repetition_penalty=1.0, use_draft=use_draft)
            what = f"{name} {'speculative' if use_draft else 'target-only'} ({len(ids)}-token prompt)"
            same = compare(hf, ids, r.tokens, ref, what)
            print(f"{what}: {same}/{len(ref)} tokens equal HF's; {tok.decode(ref)[:60]!r}")
