"""models/whisper.py against Hugging Face's WhisperForConditionalGeneration on tiny random
models: the encoder's cross-attention K/V, the decoder's logits over the static cache (a
prefill, then token by token, then a multi-token verify-shaped call), and greedy decoding equal
to Hugging Face's `generate`."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the export extra is not installed")

from draftproof.models.common import UnsupportedModel  # noqa: E402
from draftproof.models.whisper import Whisper  # noqa: E402


def tiny(seed=0, **over):
    torch.manual_seed(seed)
    cfg = transformers.WhisperConfig(
        vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16, max_target_positions=40, decoder_start_token_id=1,
        pad_token_id=0, eos_token_id=2, bos_token_id=1, begin_suppress_tokens=None,
        suppress_tokens=None, **over)
    return transformers.WhisperForConditionalGeneration(cfg).eval()


def features(hf, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, hf.config.num_mel_bins, 2 * hf.config.max_source_positions, generator=g)


def run_decoder(ours, ids, chunks, cross):
    """Our decoder over `ids` in calls of the given sizes, the cache written as the runtime
    writes it; the logits of every position."""
    d = ours.decoder
    cache = [torch.zeros(d.cache_shape()) for _ in range(2 * d.n_layers)]
    out, pos = [], 0
    for n in chunks:
        logits, *present = d(ids[:, pos : pos + n], torch.tensor(pos), n, *cache, *cross)
        for slot, new in zip(cache, present):
            slot[:, :, pos : pos + n] = new
        out.append(logits)
        pos += n
    return torch.cat(out, 1)


def test_encoder_and_decoder_are_hugging_faces():
    hf = tiny()
    x = features(hf)
    ours = Whisper.from_hf(hf, max_len=24)
    with torch.no_grad():
        enc = hf.model.encoder(x).last_hidden_state
        cross = ours.encoder(x)
        for i, layer in enumerate(hf.model.decoder.layers):
            k = layer.encoder_attn.k_proj(enc).reshape(1, -1, 4, 8).transpose(1, 2)
            v = layer.encoder_attn.v_proj(enc).reshape(1, -1, 4, 8).transpose(1, 2)
            torch.testing.assert_close(cross[2 * i], k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cross[2 * i + 1], v, atol=1e-5, rtol=1e-5)
        ids = torch.tensor([[1, 5, 9, 33, 7, 61, 12, 3, 44, 18]])
        theirs = hf(input_features=x, decoder_input_ids=ids).logits
        for chunks in ([3, 1, 1, 1, 1, 1, 1, 1], [1] * 10, [2, 5, 3]):
            torch.testing.assert_close(run_decoder(ours, ids, chunks, cross), theirs,
                                       atol=1e-4, rtol=1e-4)


def test_greedy_decoding_over_the_cache_is_hugging_faces():
    """Token by token over our cache against Hugging Face's full forward at every step, on a
    model whose weights are large enough (init_std 0.5) that the greedy tokens vary."""
    hf = tiny(seed=3, init_std=0.5)
    x = features(hf, seed=4)
    ours = Whisper.from_hf(hf, max_len=24)
    with torch.no_grad():
        cross = ours.encoder(x)
        d = ours.decoder
        cache = [torch.zeros(d.cache_shape()) for _ in range(2 * d.n_layers)]
        seq = want = [1]
        for pos in range(16):
            logits, *present = d(torch.tensor([[seq[-1]]]), torch.tensor(pos), 1, *cache,
                                 *cross)
            for slot, new in zip(cache, present):
                slot[:, :, pos : pos + 1] = new
            seq = seq + [int(logits[0, -1].argmax())]
            theirs = hf(input_features=x, decoder_input_ids=torch.tensor([want])).logits
            want = want + [int(theirs[0, -1].argmax())]
    assert seq == want
    assert len(set(seq)) > 3, seq  # the comparison saw several tokens


def test_a_cache_past_the_learned_positions_is_refused():
    with pytest.raises(UnsupportedModel, match="exceeds the model's 40 learned positions"):
        Whisper.from_hf(tiny(), max_len=41)


def test_the_builds_parity_check_compares_every_encoder_position(tmp_path):
    """The build's parity run holds the exported encoder's cross K/V to Hugging Face's at all
    of the window's positions (frames / 2: 16 here), not at as many as the features have rows
    (8 mel bins); whisper-base's 80 bins against its 1500 positions failed the build."""
    from draftproof.models import for_hf_seq2seq
    from spec_export.graphs.export_seq2seq import export_seq2seq
    from spec_export.parity.check import check_parity

    hf = tiny()
    encoder, decoder = tmp_path / "encoder.onnx", tmp_path / "decoder.onnx"
    export_seq2seq(for_hf_seq2seq(hf, 24, 16), encoder, decoder, 24)
    lines = []
    diffs = check_parity(hf, decoder, [1, 5, 6, 7], encoder_path=encoder,
                         source=features(hf)[0].numpy(), log=lines.append)
    assert "source=16" in lines[0], lines[0]
    assert max(diffs.values()) < 1e-4, diffs
