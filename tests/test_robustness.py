"""Bad bundles and bad input end in one clear error (exit code 2 from the CLI, a ValueError with
the value and the fix from the API), never a traceback, a wrong answer or a token drawn from
corrupt logits. Complements test_bundle.py (damaged manifests and files) and test_cli.py (bad
sampling values, long prompts, non-UTF-8 prompt files), which this file does not repeat."""

import json

import numpy as np
import pytest

import spec_runtime
from spec_runtime import NonFiniteLogitsError, SamplingParams
from spec_runtime.decode.loop import RequestState, generate_tokens
from spec_runtime.bundle.manifest import BundleError, sha256_file
from spec_runtime.decode.stats import DecodeStats, Recorder
from draftproof.cli.specrun import main as specrun
from helpers import assert_input_error as assert_exit_2
from helpers import edit_manifest
from helpers import run as run_cli


def run(*args, input=None):
    return run_cli(specrun, *args, input=input)


def rehash(bundle, name):
    """Record a replaced file's size and sha256, as someone 'fixing' the manifest would."""
    path = bundle / name
    edit_manifest(bundle, lambda m: m["files"][name].update(bytes=path.stat().st_size,
                                                            sha256=sha256_file(path)))


# -- bundles ------------------------------------------------------------------------------------


def test_truncated_graph_with_its_sha_updated_is_refused(bundle_copy):
    graph = bundle_copy / "target.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    rehash(bundle_copy, "target.onnx")
    with pytest.raises(ValueError, match="target.onnx is not an ONNX graph"):
        spec_runtime.load(bundle_copy)
    assert_exit_2(run("generate", "hi", "--bundle", bundle_copy), "target.onnx", "re-run")


@pytest.mark.parametrize("other", ["t5", "words"])
@pytest.mark.parametrize("recorded", [True, False])
def test_tokenizer_of_another_model_is_refused(bundle_copy, other, recorded):
    """Same size (T5's 259 ids, other specials) or smaller (50 words), the sha256 updated after
    the edit: the vocabulary the manifest records gives it away, and in a bundle that records
    none (written before it did) the vocabulary size check passes and the special tokens do."""
    from tiny_models import t5_tokenizer, word_tokenizer

    tok = t5_tokenizer() if other == "t5" else word_tokenizer(50)
    tok.backend_tokenizer.save(str(bundle_copy / "tokenizer.json"))
    rehash(bundle_copy, "tokenizer.json")
    if not recorded:
        path = bundle_copy / "manifest.json"
        m = json.loads(path.read_text())
        del m["tokenizer"]["vocab_sha256"]
        path.write_text(json.dumps(m))
    with pytest.raises(BundleError, match="belongs to another model"):
        spec_runtime.load(bundle_copy)
    why = "maps tokens to other ids" if recorded else "eos_token"
    assert_exit_2(run("generate", "hi", "--bundle", bundle_copy), why, "specexport build")


def test_a_device_this_onnxruntime_lacks_names_the_fix(llama_pair):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(ValueError, match="onnxruntime-gpu") as err:
        spec_runtime.load(llama_pair[2], device="cuda")
    assert "pip uninstall -y onnxruntime" in str(err.value)
    with pytest.raises(ValueError, match="onnxruntime-gpu"):  # the draft's device too
        spec_runtime.load(llama_pair[2], draft_device="tensorrt")
    assert_exit_2(run("generate", "hi", "--bundle", llama_pair[2], "--device", "cuda"),
                  "CUDAExecutionProvider", "onnxruntime-gpu")
    assert_exit_2(run("generate", "hi", "--bundle", llama_pair[2], "--device", "npu"), "'npu'")


@pytest.mark.parametrize("where", ["top", "target"])
def test_a_precision_this_runtime_lacks_is_refused(bundle_copy, where):
    edit_manifest(bundle_copy, lambda m: (m if where == "top" else m["target"]).update(
        precision="fp8"))
    with pytest.raises(BundleError, match="'fp8' is not one this runtime runs"):
        spec_runtime.load(bundle_copy)


@pytest.fixture
def nan_bundle(bundle_copy):
    """The target graph with its largest weight (the tied embedding) overwritten with NaN."""
    import onnx
    from onnx import numpy_helper

    path = bundle_copy / "target.onnx"
    model = onnx.load(str(path))
    floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    init = max(floats, key=lambda t: int(np.prod(t.dims)))
    weight = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(np.full_like(weight, np.nan), init.name))
    onnx.save(model, str(path))
    rehash(bundle_copy, "target.onnx")
    return bundle_copy


def test_nan_weights_stop_generation_before_any_token(nan_bundle):
    gen = spec_runtime.load(nan_bundle)
    for kwargs in ({}, {"use_draft": False}, {"temperature": 1.0, "seed": 0}):
        with pytest.raises(NonFiniteLogitsError, match="NaN"):
            gen.generate("hello", max_new_tokens=5, **kwargs)
    for flags in ([], ["--stream"], ["--json"]):
        r = run("generate", "hello", "--bundle", nan_bundle, "--max-new-tokens", 5, *flags)
        assert_exit_2(r, "NaN", "specexport verify")
        assert r.stdout == "", r.stdout  # not one token printed


class PoisonAfter:
    """Wraps an engine: after `calls` good calls, one logit of every row becomes `value`."""

    def __init__(self, engine, calls, value):
        self.engine, self.calls, self.value, self.n = engine, calls, value, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward(self, tokens, pos, num_logits=1):
        logits = self.engine.forward(tokens, pos, num_logits)
        self.n += 1
        if self.n > self.calls:
            logits = logits.copy()
            logits[:, 7] = self.value
        return logits


# every sampling control off, whatever the bundle's generation defaults say
GREEDY_OFF = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["target", "draft"])
def test_non_finite_logits_mid_generation_emit_nothing_from_them(llama_pair, value, where):
    """Rounds before the poisoned call are emitted as usual; the poisoned round raises and
    emits nothing."""
    gen = spec_runtime.load(llama_pair[2])
    gen.eos_token_ids = frozenset()
    request = gen.request(gen.tokenize("the cat sat"), max_new_tokens=30, gamma=3,
                          **dict(GREEDY_OFF, temperature=1.0), seed=1)

    def rounds(target, draft):
        out = []
        try:
            state = RequestState(request, Recorder(DecodeStats()))
            for new in generate_tokens(target, draft, state):
                out.append(new.tolist())
        except NonFiniteLogitsError:
            return out, True
        return out, False

    clean, failed = rounds(gen.target, gen.draft)
    assert not failed
    if where == "target":
        poisoned, failed = rounds(PoisonAfter(gen.target, 2, value), gen.draft)
    else:
        draft = spec_runtime.ModelDraft(PoisonAfter(gen.draft.engine, 3, value))
        poisoned, failed = rounds(gen.target, draft)
    assert failed
    assert poisoned == clean[: len(poisoned)] and len(poisoned) < len(clean)
    assert len(poisoned) == (2 if where == "target" else 1)


# -- input --------------------------------------------------------------------------------------


def test_empty_prompt_exits_2_with_or_without_chat(llama_pair):
    b = llama_pair[2]
    assert_exit_2(run("generate", "", "--bundle", b), "empty")  # chat template on by default
    assert_exit_2(run("generate", "", "--bundle", b, "--no-chat"), "empty")
    assert_exit_2(run("generate", "--bundle", b, input=""), "empty")
    gen = spec_runtime.load(b)
    for kwargs in ({}, {"chat": True}):
        with pytest.raises(ValueError, match="empty"):
            gen.generate("", **kwargs)


def test_prompt_that_exactly_fits_works_and_one_more_token_exits_2(llama_pair):
    b = llama_pair[2]
    gen = spec_runtime.load(b)
    assert len(gen.tokenize("x" * 96)) == 96 == gen.target.max_len
    r = run("generate", "x" * 96, "--bundle", b, "--no-chat", "--max-new-tokens", 1, "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["tokens"]) == 1
    r = run("generate", "x" * 94, "--bundle", b, "--no-chat", "--max-new-tokens", 3, "--json",
            "--temperature", 1, "--seed", 2)  # speculative rounds up to the last slot
    assert r.exit_code == 0 and len(json.loads(r.stdout)["tokens"]) == 3, r.output
    assert_exit_2(run("generate", "x" * 97, "--bundle", b, "--no-chat", "--max-new-tokens", 1),
                  "97 tokens", "max_len is 96")
    assert_exit_2(run("generate", "x" * 96, "--bundle", b, "--no-chat", "--max-new-tokens", 2),
                  "max_len is 96")


@pytest.mark.parametrize("bad", [259, -1, 2**63, 10**30, 1.5, True, "7"])
def test_token_ids_outside_the_vocabulary_are_refused(llama_pair, bad):
    gen = spec_runtime.load(llama_pair[2])
    with pytest.raises(ValueError, match="out of the vocabulary") as err:
        gen.generate([5, bad, 6], max_new_tokens=2)
    assert repr(bad) in str(err.value)


def test_non_utf8_prompt_on_stdin_or_argv_exits_2(llama_pair):
    b = llama_pair[2]
    assert_exit_2(run("generate", "--bundle", b, input=b"caf\xe9 au lait"), "stdin",
                  "not UTF-8")
    assert_exit_2(run("generate", "caf\udce9", "--bundle", b), "not UTF-8")
    assert_exit_2(run("generate", "--prompt-file", "/no/such/file", "--bundle", b),
                  "/no/such/file")


def test_threads_default_to_physical_cores(tmp_path, monkeypatch):
    """Two logical CPUs of one core (SMT siblings) count once; an unreadable topology falls back
    to the usable logical CPUs."""
    from spec_runtime.engines import ort as ort_engine

    for cpu, core in enumerate([0, 0, 1, 1, 2, 3]):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(ort_engine, "SYSFS_CPU", tmp_path)
    monkeypatch.setattr(ort_engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert ort_engine.physical_cores() == 4
    monkeypatch.setattr(ort_engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    assert ort_engine.physical_cores() == 7  # cpu6 has no topology: count logical CPUs


# -- API values of the wrong kind ---------------------------------------------------------------


def test_stop_takes_none_one_string_or_a_list_of_non_empty_strings(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    free = gen.generate("hello", max_new_tokens=12)
    # one string is one stop string, not its characters: a string whose first character the
    # output holds, but not the whole string, stops nothing
    lone = free.text[0] + "\x00 never"
    for stop in (None, (), lone, [lone]):
        assert gen.generate("hello", max_new_tokens=12, stop=stop).tokens == free.tokens, stop
        assert "".join(gen.stream("hello", max_new_tokens=12, stop=stop)) == free.text
    cut = free.text[3:6]
    assert gen.generate("hello", max_new_tokens=12, stop=cut).text == \
        gen.generate("hello", max_new_tokens=12, stop=[cut]).text == free.text[:free.text.find(cut)]
    for bad, words in (([""], "stop string ''"), (["a", 3], "stop string 3"),
                       (5, "stop=5"), ({"a"}, "stop={'a'}")):
        with pytest.raises(ValueError, match=words):
            gen.generate("hello", max_new_tokens=3, stop=bad)
        with pytest.raises(ValueError, match=words):
            list(gen.stream("hello", max_new_tokens=3, stop=bad))


@pytest.mark.parametrize("chat", [False, True])
def test_prompts_of_the_wrong_kind_are_refused_with_the_fix(llama_pair, chat):
    gen = spec_runtime.load(llama_pair[2])
    for prompt, words in ((b"Hi", "is bytes: decode it"), (bytearray(b"Hi"), "is bytes"),
                          ("caf\udce9", "lone surrogate"),
                          ({"role": "user"}, "dict" if not chat else "messages is a dict")):
        with pytest.raises(ValueError, match=words):
            gen.generate(prompt, max_new_tokens=2, chat=chat)
    assert_exit_2(run("generate", "--bundle", llama_pair[2], input="caf\udce9".encode(
        "utf-8", "surrogateescape")), "not UTF-8")


def test_token_id_arrays_must_be_one_dimensional_integers(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    ids = [5, 6, 7]
    want = gen.generate(ids, max_new_tokens=4).tokens
    assert gen.generate(np.array(ids), max_new_tokens=4).tokens == want
    assert gen.generate(tuple(ids), max_new_tokens=4).tokens == want
    for bad in (np.array([ids]), np.array(ids, dtype=np.float32)):
        with pytest.raises(ValueError, match="1-D integer array"):
            gen.generate(bad, max_new_tokens=2)


def test_numpy_scalars_are_numbers(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    plain = gen.generate("hi", max_new_tokens=8, temperature=0.5, top_p=0.75, top_k=20, seed=3)
    numpy = gen.generate("hi", max_new_tokens=np.int64(8), temperature=np.float32(0.5),
                         top_p=np.float32(0.75), top_k=np.int32(20), seed=np.uint16(3))
    assert numpy.tokens == plain.tokens
    with pytest.raises(ValueError, match=r"temperature=True"):
        SamplingParams(temperature=np.bool_(True))


def test_a_subnormal_temperature_is_greedy_without_warnings(llama_pair):
    """The limit of sampling as the temperature goes to 0 is the argmax: logits / 5e-324
    overflow to -inf everywhere but at the maximum, silently."""
    import warnings

    gen = spec_runtime.load(llama_pair[2])
    greedy = gen.generate("hello", max_new_tokens=10).tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (5e-324, 1e-310):
            assert gen.generate("hello", max_new_tokens=10, temperature=t, seed=1).tokens == greedy
