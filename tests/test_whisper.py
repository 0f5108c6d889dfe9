"""Whisper bundles end to end on tiny random multilingual Whispers (tiny_models.whisper: 80 mel
bins, a window of 32 frames = 0.32 s): the build, transcription equal to Hugging Face's
Whisper `generate` token for token (its prompt, language detection and suppressed tokens
included) with and without the draft, a sampled joint against exact enumeration, the self
draft, `specrun transcribe` and `specrun bench --audio`, and bad input.

The oracle is transformers' WhisperForConditionalGeneration on the same saved weights, fed
the same features (spec_runtime.audio.log_mel, itself held to WhisperFeatureExtractor by
test_audio.py).
"""

import json
import wave

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the export extra is not installed")

import spec_runtime  # noqa: E402
from helpers import assert_input_error, edit_manifest, run  # noqa: E402
from spec_export.build import build_bundle  # noqa: E402
from spec_runtime.audio import SAMPLE_RATE, log_mel  # noqa: E402
from spec_runtime.bundle.manifest import BundleError  # noqa: E402
from toy_models import joint_p_value  # noqa: E402

THREADS = 1
FRAMES = 32  # tiny_models.whisper's window: 2 * 16 positions
N = 24  # new tokens per transcription
# what the tiny models never emit (as Whisper's generation_config suppresses its task tokens):
# <|startoftranscript|>, the languages, the tasks, <|notimestamps|>
SPECIALS = list(range(257, 264))


def signal(seed: int, seconds: float = 0.25) -> np.ndarray:
    """Tones and noise: a different input for every seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    tones = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t)
                for _ in range(3))
    return (tones + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def write_wav(path, samples, rate=SAMPLE_RATE):
    """16-bit PCM of `samples`: [n] mono, or [n, channels]."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1 if pcm.ndim == 1 else pcm.shape[1])
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return path


def _save(root, model, name):
    from tiny_models import save, whisper_tokenizer

    return save(model, root / name, whisper_tokenizer())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, bundle): a 2-layer target and its first decoder layer as the draft."""
    from tiny_models import truncated_whisper, whisper

    root = tmp_path_factory.mktemp("whisper")
    target = whisper(0, suppress=SPECIALS)
    t = _save(root, target, "target")
    d = _save(root, truncated_whisper(target, 1), "draft")
    return t, build_bundle(str(t), str(d), root / "bundle", progress=False)


_HF: dict = {}


def hf_model(model_dir):
    if model_dir not in _HF:
        _HF[model_dir] = transformers.WhisperForConditionalGeneration.from_pretrained(
            model_dir).eval()
    return _HF[model_dir]


def features(x) -> torch.Tensor:
    return torch.tensor(log_mel(x, 80, FRAMES))[None]


def hf_transcribe(model_dir, x, language, task="transcribe", n=N) -> list[int]:
    with torch.no_grad():
        out = hf_model(model_dir).generate(input_features=features(x), language=language,
                                           task=task, max_new_tokens=n, do_sample=False)
    return out[0].tolist()


def test_the_manifest_records_the_speech_contract(pair):
    _, bundle = pair
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["schema_version"] == 5 and m["architecture"] == "encoder-decoder"
    assert m["max_source_len"] == 16 and m["max_len"] == 64  # the model's window and positions
    assert m["audio"]["languages"] == {"en": 258, "fr": 259, "de": 260}
    assert m["audio"]["tasks"] == {"translate": 261, "transcribe": 262}
    assert m["audio"]["no_timestamps_token_id"] == 263
    encoder = m["target"]["graphs"]["encoder"]
    assert encoder["inputs"] == [{"name": "input_features", "dtype": "float32",
                                  "shape": [1, 80, FRAMES]}]
    names = [i["name"] for i in m["target"]["graphs"]["decoder"]["inputs"]]
    assert "source_mask" not in names and "cross_key.0" in names


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_transcripts_are_hugging_faces(pair, seed):
    """Speculative (γ 1 and 4) == target-only == transformers' generate, for a given language,
    the detected one, and the translate task."""
    model_dir, bundle = pair
    gen = spec_runtime.load(bundle, threads=THREADS)
    x = signal(seed)
    seen = set()
    for language, task in ((None, "transcribe"), ("fr", "transcribe"), ("de", "translate")):
        want = hf_transcribe(model_dir, x, language, task)
        plain = gen.transcribe(x, max_new_tokens=N, language=language, task=task,
                               use_draft=False)
        assert plain.tokens == want, (language, task)
        for gamma in (1, 4):
            spec = gen.transcribe(x, max_new_tokens=N, language=language, task=task,
                                  gamma=gamma)
            assert spec.tokens == want and spec.text == plain.text, (language, task, gamma)
        assert spec.stats.prompt_tokens == 4 and spec.stats.encode_time_s > 0
        seen.add(tuple(want))
    assert len(seen) > 1  # the prompt matters to this model: the comparison can fail


def test_language_detection_is_hugging_faces(pair):
    model_dir, bundle = pair
    gen = spec_runtime.load(bundle, threads=THREADS)
    codes = {258: "en", 259: "fr", 260: "de"}
    found = set()
    for seed in range(8):
        x = signal(seed)
        with torch.no_grad():
            want = int(hf_model(model_dir).detect_language(features(x))[0])
        request = gen.transcription(x, max_new_tokens=4)
        assert request.prefix.tolist() == [257, want, 262, 263]
        found.add(codes[want])
    print(f"detected: {sorted(found)}")


@pytest.fixture(scope="module")
def suppressed(pair, tmp_path_factory):
    """The same target with suppress_tokens (the token it emits most) and begin_suppress_tokens
    (the first token it emits, and the end of text), as a generation_config sets them; its
    first decoder layer as the draft."""
    from tiny_models import truncated_whisper

    model_dir, _ = pair
    x = signal(0)
    plain = hf_transcribe(model_dir, x, "en")
    common = int(np.bincount(plain).argmax())
    first = plain[0] if plain[0] != common else plain[1]
    model = hf_model(model_dir)
    root = tmp_path_factory.mktemp("whisper_suppressed")
    config = model.generation_config
    kept = config.suppress_tokens, config.begin_suppress_tokens
    config.suppress_tokens, config.begin_suppress_tokens = SPECIALS + [common], [first, 256]
    try:
        t = _save(root, model, "target")
        d = _save(root, truncated_whisper(model, 1), "draft")
    finally:
        config.suppress_tokens, config.begin_suppress_tokens = kept
    bundle = build_bundle(str(t), str(d), root / "bundle", max_len=16, progress=False)
    return t, bundle, common, first


def test_suppressed_tokens_are_hugging_faces(suppressed):
    model_dir, bundle, common, first = suppressed
    gen = spec_runtime.load(bundle, threads=THREADS)
    for seed in range(3):
        x = signal(seed)
        want = hf_transcribe(model_dir, x, "en", n=12)
        assert common not in want
        for use_draft in (False, True):
            got = gen.transcribe(x, max_new_tokens=12, language="en", use_draft=use_draft,
                                 gamma=3)
            assert got.tokens == want
            assert got.tokens[0] not in (first, 256)


def exact_joint(model_dir, x, common, first, top_k):
    """p(y1, y2) of the suppressed model at temperature 1 and top_k, by enumeration over
    transformers' logits: suppressed ids -inf, the begin ids too at the first position, the top
    k kept, softmax. Computed here by hand."""
    model = hf_model(model_dir)
    prompt = [257, 258, 262, 263]
    vocab = model.config.vocab_size

    def probs(logits, at_begin):
        z = logits.double().numpy().copy()
        z[SPECIALS + [common]] = -np.inf
        if at_begin:
            z[[first, 256]] = -np.inf
        kth = np.sort(z)[-top_k]
        z[z < kth] = -np.inf
        p = np.exp(z - z.max())
        return p / p.sum()

    with torch.no_grad():
        f = features(x)
        p1 = probs(model(input_features=f, decoder_input_ids=torch.tensor([prompt])).logits[0, -1],
                   True)
        joint = np.zeros((vocab, vocab))
        for a in np.flatnonzero(p1):
            row = model(input_features=f,
                        decoder_input_ids=torch.tensor([prompt + [int(a)]])).logits[0, -1]
            joint[a] = p1[a] * probs(row, False)
    return joint


@pytest.mark.parametrize("gamma", [1, 3])
def test_sampled_pairs_follow_the_suppressed_target(suppressed, gamma):
    """Joint chi-square of the first two sampled tokens against exact enumeration."""
    model_dir, bundle, common, first = suppressed
    x = signal(1)
    top_k = 4
    exact = exact_joint(model_dir, x, common, first, top_k)
    gen = spec_runtime.load(bundle, threads=THREADS)
    gen.eos_token_ids = frozenset()
    counts = np.zeros_like(exact)
    accepted = 0
    draws = 2000
    for seed in range(draws):
        r = gen.transcribe(x, max_new_tokens=max(2, gamma + 1), language="en", gamma=gamma,
                           temperature=1.0, top_k=top_k, seed=seed)
        counts[r.tokens[0], r.tokens[1]] += 1
        accepted += r.stats.accepted
    p = joint_p_value(counts, exact)
    print(f"γ={gamma}: p-value={p:.4f} accepted={accepted}")
    assert p > 1e-4 and accepted > 0


def int8_head_rows(path) -> int | None:
    """N of the graph's 8-bit MatMul whose output is the logits (the lm_head), or None when the
    head stayed float (a tied embedding the quantizer could not reach)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    node = producer["logits"]
    while node.op_type not in ("MatMulNBits", "MatMul", "Gemm"):  # Reshape, Cast ...
        node = producer[node.input[0]]
    if node.op_type != "MatMulNBits":
        return None
    return next(a.i for a in node.attribute if a.name == "N")


def test_a_self_draft_is_the_targets_own_int8_decoder_over_its_encoder(pair, tmp_path):
    model_dir, _ = pair
    bundle = build_bundle(str(model_dir), "self", tmp_path / "self", progress=False)
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["draft"]["kind"] == "model" and m["draft"]["precision"] == "int8"
    # its decoder only: it reads the target's encoder output, one encoder per request
    assert set(m["draft"]["graphs"]) == {"decoder"} and m["draft"]["shared_encoder"] is True
    assert not any(f.startswith("draft.encoder") for f in m["files"])
    gen = spec_runtime.load(bundle, threads=THREADS)
    assert type(gen.draft.engine).__name__ == "SharedEncoderEngine"
    assert int8_head_rows(bundle / "draft.decoder.onnx") == m["target"]["vocab_size"]
    for seed in range(2):
        x = signal(seed)
        want = hf_transcribe(model_dir, x, "en")
        assert gen.transcribe(x, max_new_tokens=N, language="en", gamma=3).tokens == want


# -- the command line ---------------------------------------------------------------------


def test_specrun_transcribe_and_bench(pair, tmp_path):
    from draftproof.cli.specrun import main as specrun

    model_dir, bundle = pair
    x = signal(2)
    wav = write_wav(tmp_path / "speech.wav", x)
    r = run(specrun, "transcribe", wav, "-b", bundle, "--language", "fr", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    # the file's 16-bit samples are what both read
    read = spec_runtime.read_audio(wav)
    assert out["tokens"][:N] == hf_transcribe(model_dir, read, "fr", n=N)
    assert out["language"] == "fr"
    # no max_new_tokens: transformers' default length (generation_config.max_length, the
    # model's max_target_positions, prompt included) cuts the transcript where ours is cut
    with torch.no_grad():
        whole = hf_model(model_dir).generate(input_features=features(read), language="fr",
                                             task="transcribe", do_sample=False)[0].tolist()
    assert out["tokens"] == whole and len(whole) > N, (len(out["tokens"]), len(whole))
    r = run(specrun, "bench", "-b", bundle, "--audio", wav, "--max-new-tokens", 16, "--json",
            "--gamma", "1,3")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert {row["kind"] for row in report["rows"]} == {"speech"}
    assert all(row["identical"] == row["runs"] for row in report["rows"]), report["rows"]
    assert all(row["encode_ms"] > 0 for row in report["rows"])


def test_specrun_check_on_a_speech_bundle(pair):
    """The exactness check runs on built-in signals: greedy parity and the two-sample test."""
    from draftproof.cli.specrun import main as specrun

    r = run(specrun, "check", "-b", pair[1], "--samples", 150, "--top-k", 3, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["consistent"] and len(report["greedy"]["prompts"]) == 3
    assert report["sampling"]["draft_accepted"] > 0 and report["sampling"]["p_value"] is not None


def test_bad_input_is_one_line_and_exit_2(pair, llama_pair, tmp_path):
    from draftproof.cli.specrun import main as specrun

    _, bundle = pair
    notes = tmp_path / "notes.txt"
    notes.write_text("words, not sound")
    empty = write_wav(tmp_path / "empty.wav", np.zeros(0))
    long = write_wav(tmp_path / "long.wav", signal(0, seconds=1.0))
    slow = write_wav(tmp_path / "slow.wav", np.zeros(400), rate=4000)
    ok = write_wav(tmp_path / "ok.wav", signal(0))
    for args, words in (
        ((notes,), ("notes.txt", "is not audio", "ffmpeg")),
        ((empty,), ("empty.wav", "holds no samples")),
        ((long,), ("1.0 s long", "at most 0.32 s", "ffmpeg")),
        ((slow,), ("4000 Hz", "ffmpeg -i INPUT -ar 16000")),
        ((tmp_path / "missing.wav",), ("missing.wav", "does not exist")),
        ((ok, "--language", "xx"), ("--language", "'xx'", "en", "fr")),
    ):
        assert_input_error(run(specrun, "transcribe", *args, "-b", bundle), *words)
    assert_input_error(run(specrun, "generate", "hello", "-b", bundle),
                       "speech model", "specrun transcribe")
    assert_input_error(run(specrun, "transcribe", ok, "-b", llama_pair[2]),
                       "text model", "speech bundle", "specrun generate")
    assert_input_error(run(specrun, "bench", "-b", bundle), "--audio")
    assert_input_error(run(specrun, "bench", "-b", llama_pair[2], "--audio", ok),
                       "text model", "--audio")
    assert_input_error(run(specrun, "check", "-b", llama_pair[2], "--audio", ok),
                       "text model")


def test_python_api_refuses_what_is_not_samples(pair):
    _, bundle = pair
    gen = spec_runtime.load(bundle, threads=THREADS)
    for audio, words in ((b"RIFF", "bytes"), (np.zeros((2, 100)), "mono"),
                         (np.array([0.1, np.nan]), "NaN"), (np.zeros(0), "no samples"),
                         (np.zeros(SAMPLE_RATE), "at most 0.32 s")):
        with pytest.raises(spec_runtime.InputError, match=words):
            gen.transcribe(audio, max_new_tokens=4, language="en")
    with pytest.raises(spec_runtime.InputError, match="transcribe"):
        gen.generate("hello", max_new_tokens=4)


@pytest.mark.parametrize("damage, match", [
    (lambda m: m["audio"]["languages"].update(en=10**6), r"audio.languages\['en'\]"),
    (lambda m: m.update(schema_version=4), "schema 5"),
    (lambda m: m["audio"].update(n_mels=128), "does not fit"),
    (lambda m: m.pop("audio"), "does not fit"),
    (lambda m: m["audio"].update(suppress_tokens=["x"]), "audio.suppress_tokens"),
    (lambda m: m["draft"].update(shared_encoder="yes"), "draft.shared_encoder"),
    # the pair's draft has one decoder layer: it cannot read the target's two layers' K/V
    (lambda m: (m["draft"]["graphs"].pop("encoder"), m["draft"].update(shared_encoder=True)),
     "cross inputs are not the target decoder's"),
])
def test_a_damaged_audio_record_is_refused(pair, tmp_path, damage, match):
    import shutil

    _, bundle = pair
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    edit_manifest(copy, damage)
    with pytest.raises(BundleError, match=match):
        spec_runtime.load(copy, threads=THREADS)


def test_the_server_transcribes_what_openais_client_uploads(pair, tmp_path):
    """POST /v1/audio/transcriptions with the official client: the transcript of the Python
    API; bad uploads and a text route on a speech bundle get OpenAI errors, never a 500."""
    pytest.importorskip("openai", reason="the test extra installs the openai client")
    pytest.importorskip("multipart", reason="the serve extra installs python-multipart")
    import httpx
    from test_serve import assert_error, client, server

    _, bundle = pair
    wav = write_wav(tmp_path / "speech.wav", signal(1))
    want = spec_runtime.load(bundle, threads=THREADS).transcribe(
        spec_runtime.read_audio(wav), language="fr", max_new_tokens=16)
    with server(bundle) as (url, _):
        with open(wav, "rb") as f:
            got = client(url).audio.transcriptions.create(
                model="target", file=f, language="fr", extra_body={"max_tokens": 16})
        assert got.text == want.text.strip()
        with open(wav, "rb") as f:
            text = client(url).audio.transcriptions.create(
                model="target", file=f, language="fr", response_format="text",
                extra_body={"max_tokens": 16})
        assert text.strip() == want.text.strip()
        post = f"{url}/v1/audio/transcriptions"
        notes = {"file": ("notes.txt", b"words, not sound")}
        assert_error(httpx.post(post, files=notes), 400, "notes.txt", "is not audio",
                     param="file")
        long = write_wav(tmp_path / "long.wav", signal(0, seconds=1.0)).read_bytes()
        assert_error(httpx.post(post, files={"file": ("long.wav", long)}), 400,
                     "at most 0.32 s", param="file")
        ok = {"file": ("a.wav", wav.read_bytes())}
        assert_error(httpx.post(post, files=ok, data={"language": "xx"}), 400, "'xx'",
                     param="language")
        assert_error(httpx.post(post, files=ok, data={"prompt": "earlier text"}), 400,
                     "prompt", code="unsupported_parameter")
        assert_error(httpx.post(post, json={"file": "a.wav"}), 400, "multipart/form-data")
        assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}), 400,
                     "speech model", "/v1/audio/transcriptions")


def test_a_shared_encoder_draft_runs_where_the_target_runs(pair, tmp_path):
    model_dir, _ = pair
    bundle = build_bundle(str(model_dir), "self", tmp_path / "self", progress=False)
    with pytest.raises(spec_runtime.InputError, match="--draft-device cuda out"):
        spec_runtime.load(bundle, device="cpu", draft_device="cuda")


# -- WAV files as other programs write them, through `specrun` and the server -----------------


def _wav_cases(x: np.ndarray):
    """(name, bytes, samples read or None for a refusal, words of the refusal): the WAV files
    of tests/test_audio_input.py, built byte by byte; the samples expected are the 16-bit
    values written, decoded here."""
    from test_audio_input import EXTENSIBLE, PCM, chunk, fmt_chunk, riff

    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    want = (pcm / 32768).astype(np.float32)
    raw = pcm.tobytes()
    return [
        ("zero-rate.wav", riff(fmt_chunk(rate=0), chunk(b"data", raw)), None, ("0 Hz",)),
        ("40-bit.wav", riff(fmt_chunk(bits=40), chunk(b"data", bytes(500))), None, ("40-bit",)),
        ("64-bit.wav", riff(fmt_chunk(bits=64), chunk(b"data", bytes(800))), None, ("64-bit",)),
        ("huge-chunk.wav", riff(fmt_chunk(), chunk(b"LIST", b"INFO", size=0xFFFFFFF0),
                                chunk(b"data", raw)), None, ("'LIST'", "4294967280")),
        ("cut.wav", riff(fmt_chunk(), chunk(b"data", raw))[:-1], want[:-1], ()),
        ("no-pad.wav", riff(fmt_chunk(), chunk(b"LIST", b"INFOabc", pad=False),
                            chunk(b"data", raw)), want, ()),
        ("streamed.wav", riff(fmt_chunk(), chunk(b"data", raw, size=0xFFFFFFF0),
                              size=0xFFFFFFFF), want, ()),
        ("extensible.wav", riff(fmt_chunk(EXTENSIBLE, sub=PCM), chunk(b"data", raw)), want, ()),
    ]


def test_specrun_transcribe_reads_or_refuses_wav_files_as_written(pair, tmp_path):
    """Each file is read (the transcript of its samples, by transformers) or refused in one
    line with exit 2; never a traceback."""
    from draftproof.cli.specrun import main as specrun

    model_dir, bundle = pair
    for name, data, want, words in _wav_cases(signal(3)):
        path = tmp_path / name
        path.write_bytes(data)
        r = run(specrun, "transcribe", path, "-b", bundle, "--language", "fr", "--json",
                "--max-new-tokens", N)
        if want is None:
            assert_input_error(r, name, *words)
            assert len(r.output.strip().splitlines()) == 1, r.output
        else:
            assert r.exit_code == 0, (name, r.output)
            assert json.loads(r.stdout)["tokens"] == hf_transcribe(model_dir, want, "fr"), name


def _specrun_subprocess(*args):
    import subprocess
    import sys

    # a reader that waits on the pipe never returns: the limit turns a hang into a failure
    return subprocess.run([sys.executable, "-m", "draftproof.cli.specrun", *map(str, args)],
                          capture_output=True, text=True, timeout=180)


def test_a_fifo_given_as_audio_is_refused_not_waited_on(pair, tmp_path):
    import os

    if not hasattr(os, "mkfifo"):
        pytest.skip("named pipes are POSIX")
    _, bundle = pair
    fifo = tmp_path / "speech.wav"
    os.mkfifo(fifo)
    for args in (("transcribe", fifo, "-b", bundle), ("bench", "-b", bundle, "--audio", fifo)):
        r = _specrun_subprocess(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and "speech.wav" in r.stderr, r.stderr
        assert "pipe (FIFO)" in r.stderr and "save it to one" in r.stderr, r.stderr


def test_the_server_answers_a_bad_wav_upload_with_400(pair, tmp_path):
    """WAV files that used to raise inside the reader (a 500): one 400 naming the file; the
    ones that are readable are transcribed."""
    pytest.importorskip("multipart", reason="the serve extra installs python-multipart")
    import httpx
    from test_serve import assert_error, server

    _, bundle = pair
    gen = spec_runtime.load(bundle, threads=THREADS)
    with server(bundle) as (url, _):
        post = f"{url}/v1/audio/transcriptions"
        for name, data, want, words in _wav_cases(signal(4)):
            form = {"language": "fr", "max_tokens": "8"}
            r = httpx.post(post, files={"file": (name, data)}, data=form, timeout=60)
            if want is None:
                assert_error(r, 400, name, *words, param="file")
            else:
                assert r.status_code == 200, (name, r.text)
                text = gen.transcribe(want, language="fr", max_new_tokens=8).text
                assert r.json()["text"] == text.strip(), name
        # past the upload limit, chunked (no content-length): refused as it is read
        from spec_runtime.apps.transcriptions import MAX_AUDIO_BYTES

        head = (b'--b\r\ncontent-disposition: form-data; name="file"; filename="big.wav"\r\n'
                b'content-type: audio/wav\r\n\r\n')
        body = (head if i == 0 else b"\0" * (1 << 20)
                for i in range(MAX_AUDIO_BYTES // (1 << 20) + 2))
        assert_error(httpx.post(post, content=body, timeout=60, headers={
            "content-type": "multipart/form-data; boundary=b"}), 413, "send a shorter recording")


def test_a_manifest_whose_tasks_lack_transcribe_is_refused_at_load(pair, tmp_path):
    """A multilingual Whisper's prompt needs its <|transcribe|> token; a manifest without it
    is refused when the bundle is read, by the CLI too, in one line."""
    import shutil

    from draftproof.cli.specrun import main as specrun

    _, bundle = pair
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    edit_manifest(copy, lambda m: m["audio"]["tasks"].pop("transcribe"))
    with pytest.raises(BundleError, match=r"audio\.tasks.*'transcribe'.*specexport build"):
        spec_runtime.load(copy, threads=THREADS)
    wav = write_wav(tmp_path / "a.wav", signal(0))
    assert_input_error(run(specrun, "transcribe", wav, "-b", copy), "audio.tasks",
                       "transcribe", "specexport build")


def test_a_task_the_manifest_lacks_is_refused_by_the_request(pair, tmp_path):
    """tasks {"transcribe"} only (translate left out): --task translate is one line naming the
    option; transcribing works."""
    import shutil

    from draftproof.cli.specrun import main as specrun

    _, bundle = pair
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    edit_manifest(copy, lambda m: m["audio"]["tasks"].pop("translate"))
    wav = write_wav(tmp_path / "a.wav", signal(0))
    assert_input_error(run(specrun, "transcribe", wav, "-b", copy, "--task", "translate",
                           "--language", "fr"), "--task", "translate", "transcribe")
    r = run(specrun, "transcribe", wav, "-b", copy, "--language", "fr", "--max-new-tokens", 4)
    assert r.exit_code == 0, r.output


def test_an_english_only_manifest_has_no_task_tokens_and_transcribes(pair, tmp_path):
    """English-only Whispers have neither language nor task tokens: the prompt is
    <|startoftranscript|> <|notimestamps|>, and translating is refused in one line."""
    import shutil

    from draftproof.cli.specrun import main as specrun

    _, bundle = pair
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    edit_manifest(copy, lambda m: m["audio"].update(languages={}, tasks={}))
    gen = spec_runtime.load(copy, threads=THREADS)
    assert gen.transcription(signal(0), max_new_tokens=4).prefix.tolist() == [257, 263]
    wav = write_wav(tmp_path / "a.wav", signal(0))
    r = run(specrun, "transcribe", wav, "-b", copy, "--max-new-tokens", 4)
    assert r.exit_code == 0, r.output
    assert_input_error(run(specrun, "transcribe", wav, "-b", copy, "--task", "translate"),
                       "--task 'translate'", "English-only")


def test_specrun_chat_on_a_speech_bundle_points_at_transcribe(pair):
    from draftproof.cli.specrun import main as specrun

    r = run(specrun, "chat", "-b", pair[1], input="hello\n")
    assert_input_error(r, "speech model", "specrun transcribe AUDIO")
    assert "specrun generate" not in r.output, r.output
