"""Encoder-decoder bundles (T5, Whisper) built with --max-batch: their decoder's lanes graph, and
requests decoded together through it, each result the request's alone.

Oracles: the decoder graph of the same bundle run with plain ONNX Runtime (`session.run`, over
a cache the decoder graph itself wrote) for each lane; Hugging Face `generate` on the saved
weights for greedy output; the request decoded alone for everything else (seeded samples, the
draft, target-only). Where this machine's load check finds the lanes' rows differ from single
calls, batching is off and the equalities hold one request at a time (the tests print which).
"""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the export extra is not installed")

import spec_runtime  # noqa: E402
from helpers import run  # noqa: E402
from spec_export.build import build_bundle  # noqa: E402
from spec_runtime import GenerationOptions  # noqa: E402
from spec_runtime.bundle.contract import kv_names, lane_kv_names  # noqa: E402
from draftproof.cli.specexport import main as specexport  # noqa: E402

LANES = 3
T5_TEXTS = ["translate: hello", "abc", "the quick brown fox", "x y",
            "more text here", "q"]


@pytest.fixture(scope="module")
def t5_pair(tmp_path_factory):
    """(target dir, bundle): a 3-layer T5 and its 1-layer truncation, both float32, 3 lanes."""
    from tiny_models import save, t5, t5_tokenizer, truncated_t5

    root = tmp_path_factory.mktemp("t5_lanes")
    target = t5(0, layers=3)
    t = save(target, root / "t", t5_tokenizer())
    d = save(truncated_t5(target, 1), root / "d", t5_tokenizer())
    return t, build_bundle(str(t), str(d), root / "bundle", max_len=48, max_source_len=24,
                           gamma=3, max_batch=LANES, progress=False)


@pytest.fixture(scope="module")
def whisper_pair(tmp_path_factory):
    """(target dir, bundle): a 2-layer multilingual Whisper and its first decoder layer."""
    from test_whisper import SPECIALS
    from tiny_models import save, truncated_whisper, whisper, whisper_tokenizer

    root = tmp_path_factory.mktemp("whisper_lanes")
    target = whisper(0, suppress=SPECIALS)
    t = save(target, root / "t", whisper_tokenizer())
    d = save(truncated_whisper(target, 1), root / "d", whisper_tokenizer())
    return t, build_bundle(str(t), str(d), root / "bundle", max_batch=LANES, progress=False)


def _counting(lanes):
    """Record the sequences of every call of `lanes` (a LaneEngine) in a list."""
    calls = []
    forward = lanes.forward
    lanes.forward = lambda c: calls.append(len(c)) or forward(c)
    return calls


@pytest.mark.parametrize("kind", ["t5", "whisper"])
def test_the_manifest_records_each_models_lanes_graph(kind, t5_pair, whisper_pair):
    _, bundle = t5_pair if kind == "t5" else whisper_pair
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["max_batch"] == LANES and m["schema_version"] == 6
    for role in ("target", "draft"):
        graphs = m[role]["graphs"]
        lanes = graphs["decoder_lanes"]
        assert lanes["file"] == f"{role}.lanes.onnx"
        assert (lanes["kernels"], lanes["kv_cache"]) == ("portable", "new-slots")
        names = [i["name"] for i in lanes["inputs"]]
        assert "cross_key.0.lane2" in names and ("source_mask" in names) == (kind == "t5")
        record = m[role]["parity"]["lanes"]
        assert 0 <= record["max_abs_diff"] <= record["tolerance"], record
        print(f"{kind} {role}: lanes vs decoder max |Δlogit| {record['max_abs_diff']}")
    spec_runtime.bundle.manifest.read_manifest(bundle)  # the runtime's reader takes it


def test_each_t5_lane_is_the_decoder_graphs_call_over_its_own_history(t5_pair):
    """Three sequences, each with its own source mask, cross K/V and a history the decoder
    graph wrote at its own length, then one lanes call (one lane right-padded) against the
    decoder graph's call for each sequence: logits and new slots within float32 rounding."""
    _, bundle = t5_pair
    m = json.loads((bundle / "manifest.json").read_text())
    solo = ort.InferenceSession(str(bundle / m["target"]["graphs"]["decoder"]["file"]))
    lanes = ort.InferenceSession(str(bundle / m["target"]["graphs"]["decoder_lanes"]["file"]))
    dec = {i.name: i.shape for i in solo.get_inputs()}
    nl = sum(1 for k in dec if k.startswith("past_key."))
    cache_shape, cross_shape = dec["past_key.0"], dec["cross_key.0"]
    S, V = cross_shape[2], m["target"]["vocab_size"]
    rng = np.random.default_rng(5)
    caches, crosses, masks, positions = [], [], [], [7, 2, 12]
    for b, pos in enumerate(positions):
        cache = [np.zeros(cache_shape, np.float32) for _ in range(2 * nl)]
        cross = [rng.standard_normal(cross_shape).astype(np.float32) for _ in range(2 * nl)]
        mask = (np.arange(S) < 4 + 5 * b).astype(np.int64)[None]
        history = rng.integers(0, V, (1, pos))
        out = solo.run(None, {"input_ids": history, "position": np.array(0),
                              "num_logits": np.array(1), **dict(zip(kv_names("past", nl), cache)),
                              **dict(zip(kv_names("cross", nl), cross)), "source_mask": mask})
        for buf, new in zip(cache, out[1:]):
            buf[:, :, :pos] = new
        caches.append(cache), crosses.append(cross), masks.append(mask)
    n, k, real = 4, 4, [4, 2, 4]
    ids = rng.integers(0, V, (LANES, n))
    feed = {"input_ids": ids, "position": np.array(positions), "num_logits": np.array(k),
            "row_ends": np.array([max(r, k) for r in real]), "source_mask": np.concatenate(masks)}
    for prefix, per in (("past", caches), ("cross", crosses)):
        for j, name in enumerate(lane_kv_names(prefix, nl, LANES)):  # (layer, lane, k then v)
            feed[name] = per[(j // 2) % LANES][2 * (j // (2 * LANES)) + j % 2]
    logits, *presents = lanes.run(None, feed)
    for b in range(LANES):
        rows = min(k, real[b])
        want, *new = solo.run(None, {
            "input_ids": ids[b:b + 1, :real[b]], "position": np.array(positions[b]),
            "num_logits": np.array(rows), **dict(zip(kv_names("past", nl), caches[b])),
            **dict(zip(kv_names("cross", nl), crosses[b])), "source_mask": masks[b]})
        # lane b's rows end at row_ends[b] = k: a padded lane's own are before its fillers'
        end = k - (max(real[b], k) - real[b])
        np.testing.assert_allclose(logits[b, end - rows:end], want[0], atol=1e-5, rtol=1e-5)
        for i in range(2 * nl):
            got = presents[2 * ((i // 2) * LANES + b) + i % 2][:, :, :real[b]]
            np.testing.assert_allclose(got, new[i], atol=1e-5, rtol=1e-5)


def test_t5_requests_together_are_each_the_requests_alone(t5_pair):
    target_dir, bundle = t5_pair
    gen = spec_runtime.load(bundle)
    lanes, check, _ = gen.lanes
    print(f"target lanes: {check}; draft lanes: {gen.draft_lanes and gen.draft_lanes[1]}")
    options = [GenerationOptions(max_new_tokens=20),
               GenerationOptions(max_new_tokens=18, temperature=0.9, seed=4),
               GenerationOptions(max_new_tokens=12, gamma=1),
               GenerationOptions(max_new_tokens=16, use_draft=False),
               GenerationOptions(max_new_tokens=22, temperature=1.2, top_k=20, seed=9),
               GenerationOptions(max_new_tokens=9, logprobs=2)]
    requests = [gen.request(p, o) for p, o in zip(T5_TEXTS, options)]
    alone = [gen.generate(r) for r in requests]
    calls = _counting(lanes)
    together = gen.generate_batch(requests)
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
    assert [t.logprob for t in together[-1].logprobs] == [t.logprob for t in alone[-1].logprobs]
    if check.identical:
        assert gen.max_batch == LANES and max(calls) == LANES, calls
    else:
        assert gen.max_batch == 1 and not calls
    # greedy: Hugging Face's own generate on the saved weights
    hf = transformers.T5ForConditionalGeneration.from_pretrained(target_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(target_dir)
    greedy = gen.generate_batch(T5_TEXTS, GenerationOptions(max_new_tokens=20))
    for text, result in zip(T5_TEXTS, greedy):
        with torch.no_grad():
            want = hf.generate(**tok(text, return_tensors="pt"), max_new_tokens=20,
                               do_sample=False)[0].tolist()[1:]
        assert result.tokens == want[: len(result.tokens)] and (
            len(result.tokens) == 20 or want[len(result.tokens) - 1] == tok.eos_token_id)


def test_whisper_transcriptions_together_are_each_alone_and_hugging_faces(whisper_pair):
    from test_whisper import N, hf_transcribe, signal

    target_dir, bundle = whisper_pair
    gen = spec_runtime.load(bundle, threads=1)
    lanes, check, _ = gen.lanes
    print(f"target lanes: {check}; draft lanes: {gen.draft_lanes and gen.draft_lanes[1]}")
    clips = [signal(seed) for seed in range(5)]
    languages = ["en", "fr", None, "de", "en"]
    options = [GenerationOptions(max_new_tokens=N), GenerationOptions(max_new_tokens=N),
               GenerationOptions(max_new_tokens=N, use_draft=False),
               GenerationOptions(max_new_tokens=N, temperature=0.8, seed=3),
               GenerationOptions(max_new_tokens=N, gamma=2)]
    requests = [gen.transcription(x, o, language=lang)
                for x, o, lang in zip(clips, options, languages)]
    alone = [gen.generate(r) for r in requests]
    calls = _counting(lanes)
    together = gen.generate_batch(requests)
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens and b.text == a.text
    if check.identical:
        assert max(calls) == LANES, calls
    for i in (0, 1, 4):  # greedy with a given language: Hugging Face's transcript
        assert together[i].tokens == hf_transcribe(target_dir, clips[i], languages[i]), i


def test_int8_encoder_decoder_with_max_batch_is_refused(tmp_path):
    from tiny_models import save, t5, t5_tokenizer

    target = save(t5(0, layers=1), tmp_path / "t", t5_tokenizer())
    r = run(specexport, "build", "--target", target, "--draft", "ngram", "--precision", "int8",
            "--max-batch", "2", "--out", tmp_path / "b", "--quiet")
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert "--max-batch 2" in line and "--precision 'int8'" in line and "--precision 'fp32'" in line
    assert "Traceback" not in r.output and not (tmp_path / "b").exists()


def test_the_server_transcribes_uploads_together(whisper_pair, tmp_path):
    """`specrun serve --slots 3` on the lanes bundle: concurrent uploads (their languages given
    or detected) each get the transcript the Python API gives it alone, and /metrics shows calls
    that carried several."""
    pytest.importorskip("multipart", reason="the serve extra installs python-multipart")
    import re
    import threading

    import httpx
    from test_serve import server
    from test_whisper import signal, write_wav

    _, bundle = whisper_pair
    gen = spec_runtime.load(bundle, threads=1)
    jobs = []
    for i in range(6):
        wav = write_wav(tmp_path / f"{i}.wav", signal(10 + i))
        language = [None, "fr", "en"][i % 3]
        alone = gen.transcribe(spec_runtime.read_audio(wav), language=language,
                               max_new_tokens=16)
        jobs.append((wav, language, alone.text.strip()))
    got, errors = {}, []

    def one(i, url, model):
        wav, language, _ = jobs[i]
        data = {"model": model, "max_tokens": "16", **({"language": language} if language
                                                        else {})}
        try:
            r = httpx.post(f"{url}/v1/audio/transcriptions", data=data, timeout=300,
                           files={"file": (wav.name, wav.read_bytes())})
            r.raise_for_status()
            got[i] = r.json()["text"]
        except Exception as e:  # reported below, with the others
            errors.append((i, repr(e)))

    with server(bundle, "--slots", "3", "--queue", "8") as (url, _):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        threads = [threading.Thread(target=one, args=(i, url, model))
                   for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        metrics = httpx.get(url + "/metrics").text
    assert not errors, errors
    for i, (_, _, want) in enumerate(jobs):
        assert got[i] == want, (i, got[i], want)
    sizes = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r'^draftproof_batch_calls_total\{size="(\d+)"\} (\S+)$', metrics, re.M)}
    print("calls by requests carried:", sizes)
    if gen.max_batch > 1:
        assert any(n >= 2 and k > 0 for n, k in sizes.items()), sizes


def test_a_speech_bundles_language_detection_never_waits_behind_a_slot(whisper_pair, tmp_path):
    """The server's slots over a speech bundle are forks: the loaded generator, which detects
    an upload's language before a slot is taken, is none of them, so a detection goes on while
    every slot decodes (here: while each slot's engines are held)."""
    import threading

    from spec_runtime.apps.slots import Slots
    from spec_runtime.apps.transcriptions import make_request
    from spec_runtime.apps.openai_api import Job
    from test_whisper import signal, write_wav

    _, bundle = whisper_pair
    for max_batch in (LANES, 1):
        gen = spec_runtime.load(bundle, threads=1)
        if max_batch == 1:  # the same bundle without its lanes: a fork per slot
            gen.lanes = None
        slots = Slots(gen, 2, 4)
        assert all(g is not gen for g in slots.generators)
        wav = write_wav(tmp_path / "a.wav", signal(3))
        job = Job(prompt=None, chat=False, max_tokens=8, stream=False, include_usage=False,
                  kwargs={}, prompt_field="file")
        held = [g._lock for g in slots.generators]
        for lock in held:
            lock.acquire()
        try:
            with open(wav, "rb") as audio:
                done = threading.Thread(target=make_request, args=(
                    gen, job, {"audio": audio, "name": "a.wav", "language": None,
                               "format": "json"}))
                done.start()
                done.join(timeout=120)  # waiting behind a held slot would never end
            assert not done.is_alive() and job.request is not None
        finally:
            for lock in held:
                lock.release()


def test_no_call_runs_beside_another_in_an_encoder_decoder_batch(t5_pair, monkeypatch):
    """Encoder passes, prompts and lanes calls of T5 requests decoded together: each waits at
    the gate and runs with nothing beside it (each call made to take 5 ms more: a window in
    which another starting would show), and every result is its request's alone."""
    import threading
    import time

    from spec_runtime.engines.lanes import LaneEngine
    from spec_runtime.engines.ort_encdec import OrtEncDecEngine
    from spec_runtime.engines.protocol import ChunkedEngine

    _, bundle = t5_pair
    gen = spec_runtime.load(bundle, threads=1)
    options = GenerationOptions(max_new_tokens=10)
    want = [gen.generate(t, options).tokens for t in T5_TEXTS]
    state = {"active": 0, "most": 0}
    lock = threading.Lock()

    def counted(call):
        def wrapped(*args, **kwargs):
            with lock:
                state["active"] += 1
                state["most"] = max(state["most"], state["active"])
            try:
                time.sleep(0.005)
                return call(*args, **kwargs)
            finally:
                with lock:
                    state["active"] -= 1
        return wrapped

    for cls, name in ((LaneEngine, "forward"), (ChunkedEngine, "forward"),
                      (OrtEncDecEngine, "encode_source")):
        monkeypatch.setattr(cls, name, counted(getattr(cls, name)))
    calls = _counting(gen.lanes[0])
    got = gen.generate_batch(T5_TEXTS, options)
    assert [r.tokens for r in got] == want
    print(f"lanes calls by sequences carried: {np.bincount(calls)}; at once: {state['most']}")
    if gen.max_batch > 1:
        assert max(calls) >= 2
    assert state["most"] == 1, state


def test_a_language_detected_as_the_request_runs_is_the_one_detected_before(whisper_pair):
    """Generator.transcription(detect_later=True) (the server's uploads): no encoder runs when
    the request is made; the slot that decodes it detects the language from its own encoding,
    and the transcript is the one of the language detected up front (itself Hugging Face's:
    test_whisper.py), alone and in a batch."""
    from test_whisper import N, signal

    from spec_runtime.decode.drafts import draft_engines
    from spec_runtime.engines.ort_encdec import OrtEncDecEngine

    _, bundle = whisper_pair
    gen = spec_runtime.load(bundle, threads=1)
    clips = [signal(seed) for seed in range(6)]
    options = GenerationOptions(max_new_tokens=N)
    eager = [gen.transcription(x, options) for x in clips]
    encoded = []
    encode = OrtEncDecEngine.encode_source
    OrtEncDecEngine.encode_source = lambda self, source: encoded.append(1) or encode(self,
                                                                                    source)
    try:
        later = [gen.transcription(x, options, detect_later=True) for x in clips]
        assert not encoded and all(r.detect_at == 1 for r in later)
        alone = [gen.fork().generate(r) for r in later]
        # one encoder pass a request and model: the target's, and its draft model's own
        models = 1 + sum(isinstance(e, OrtEncDecEngine) for e in draft_engines(gen.draft))
        assert len(encoded) == models * len(clips)
        together = gen.generate_batch(later)
    finally:
        OrtEncDecEngine.encode_source = encode
    want = [gen.generate(r) for r in eager]
    for w, a, b in zip(want, alone, together):
        assert a.tokens == w.tokens and b.tokens == w.tokens
    # the placeholder is not the detected language, and decoding from it would differ: a
    # request that kept it would fail the equalities above
    held = [int(r.prefix[1]) for r in later]
    assert any(int(r.prefix[1]) != h for r, h in zip(eager, held))
    code = next(c for c, t in gen.audio.languages.items() if t == held[0])
    assert any(gen.transcribe(x, options, language=code).tokens != w.tokens
               for x, w in zip(clips, want))
