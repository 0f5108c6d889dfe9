"""The encoder-decoder (T5) part of `specexport build`: two graphs per model, their parity, and
the manifest fields only such bundles have. build.py calls in here; everything else (loading,
vocabulary check, progress, atomic write) is shared with decoder-only bundles."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spec_runtime.bundle.contract import graph_devices
from spec_runtime.bundle.manifest import AudioEntry, GraphEntry, ModelEntry
from spec_runtime.errors import BuildError

from ..parity.quality import VERIFY_DIFF_FACTOR, VERIFY_DIFF_MARGIN

DECODER_PARITY_PREFIX = 4  # forced decoder tokens after the start token in the parity run


def decoder_start_token_id(hf_model) -> int:
    for src in (hf_model.config, getattr(hf_model, "generation_config", None)):
        start = getattr(src, "decoder_start_token_id", None) if src is not None else None
        if start is not None:
            return int(start)
    raise BuildError(
        f"{hf_model.config.model_type}: config.decoder_start_token_id is not set; the decoder "
        f"cannot start. Set it in config.json (T5 uses the pad id, 0)"
    )


def is_encoder_decoder(config) -> bool:
    from draftproof.models import is_encoder_decoder as check

    return check(config)


def check_same_kind(target_config, draft_config) -> None:
    """A model draft is of the target's architecture: encoder-decoder, or decoder-only."""
    t, d = is_encoder_decoder(target_config), is_encoder_decoder(draft_config)
    if t != d:
        kinds = {True: "encoder-decoder", False: "decoder-only"}
        raise BuildError(f"the target is {kinds[t]} ({target_config.model_type}) but the draft "
                         f"is {kinds[d]} ({draft_config.model_type}): pick a draft of the same "
                         f"architecture, or prompt lookup (draft 'ngram')")


def check_pair(t_model, d_model) -> None:
    """A model draft for an encoder-decoder target must be one too, with the same start token."""
    check_same_kind(t_model.config, d_model.config)
    if is_encoder_decoder(t_model.config) and decoder_start_token_id(t_model) != decoder_start_token_id(d_model):
        raise BuildError(
            f"target and draft start decoding from different tokens "
            f"({decoder_start_token_id(t_model)} vs {decoder_start_token_id(d_model)}): pick a "
            f"draft from the same model family"
        )


def parity_inputs(hf_model, parity_ids: list[int], max_source_len: int):
    """(source, decoder prompt) for the parity run: the parity text's ids as the source, or a
    speech model's features of a signal (tones and noise over half its window), and the start
    token plus a few of the text's ids as the decoder prompt."""
    prompt = [decoder_start_token_id(hf_model)] + list(parity_ids[:DECODER_PARITY_PREFIX])
    if is_audio(hf_model.config):
        from spec_runtime.audio import HOP_LENGTH, SAMPLE_RATE, log_mel

        frames = 2 * hf_model.config.max_source_positions
        t = np.arange(frames * HOP_LENGTH // 2) / SAMPLE_RATE
        rng = np.random.default_rng(0)
        signal = sum(0.2 * np.sin(2 * np.pi * f * t) for f in (220.0, 440.0, 1250.0)) \
            + 0.05 * rng.standard_normal(len(t))
        return log_mel(signal, hf_model.config.num_mel_bins, frames), prompt
    return list(parity_ids[:max_source_len]), prompt


def is_audio(config) -> bool:
    from draftproof.models import is_audio as check

    return check(config)


def export_model(hf_model, bundle_dir: Path, role: str, *, max_len: int, max_source_len: int,
                 precision: str, parity_ids: list[int], stage, share_encoder: bool = False,
                 max_batch: int = 1, max_gamma: int = 8, head_ids=None) -> ModelEntry:
    """Export `role`.encoder.onnx and `role`.decoder.onnx, check them against PyTorch; returns
    the model's manifest entry (its source is added by the caller). With `share_encoder` (a
    self draft at a lower precision) only the decoder is kept: it reads the target's encoder
    output, which its own float encoder, exported for the parity runs only, equals. With
    `max_batch` > 1 a float32 model also gets `role`.lanes.onnx, its decoder's lanes graph
    (models/common.py, lanes), checked against the decoder graph. `head_ids` (sorted token ids,
    a trimmed draft: draft_vocab.py): the decoder's lm_head keeps only those rows, and the
    parity runs compare them with the PyTorch model's head cut the same way."""
    from draftproof.models import for_hf_seq2seq

    from ..graphs.export_seq2seq import export_seq2seq
    from ..graphs.onnx_export import graph_entry
    from ..parity.check import check_parity, follows_float, fp32_parity_seq2seq

    if share_encoder and precision == "fp32":
        raise ValueError("a draft that shares the target's encoder is its lower precision")
    model = for_hf_seq2seq(hf_model, max_len, max_source_len)
    if head_ids is not None:  # the embedding keeps every row: the decoder reads every token
        from ..parity.calls import trim_output_head

        model.decoder.trim_lm_head(head_ids)
        trim_output_head(hf_model, head_ids)
    if precision != "fp32":  # so that the quantizer reaches a tied lm_head's MatMul
        model.decoder.untie_lm_head()
    final = {g: bundle_dir / f"{role}.{g}.onnx" for g in ("encoder", "decoder")}
    fp32 = final if precision == "fp32" else {g: p.with_suffix(".fp32.onnx") for g, p in final.items()}
    if share_encoder:
        del final["encoder"]
    descs = export_seq2seq(model, fp32["encoder"], fp32["decoder"], max_len)
    stage(f"parity {role}")
    source, decoder_ids = parity_inputs(hf_model, parity_ids, max_source_len)
    measured = fp32_parity_seq2seq(hf_model, fp32["decoder"], decoder_ids,
                                   encoder_path=fp32["encoder"], source=source, name=role)
    for graph, (diff, limit) in measured.items():
        if not diff <= limit:
            raise BuildError(
                f"{role} {graph}: exported graph differs from PyTorch by {diff:.3g} > "
                f"{limit:.3g}: the export is wrong for this model; please report it"
            )
    diffs = {g: diff for g, (diff, _) in measured.items()}
    worst = max(diffs, key=diffs.get)
    parity = {"max_abs_diff_fp32": diffs[worst], "tolerance_fp32": measured[worst][1],
              "graphs_fp32": diffs, "tolerances_fp32": {g: t for g, (_, t) in measured.items()}}
    if precision == "int8":
        from ..quantization.quantize import quantize_int8

        for g in final:
            quantize_int8(fp32[g], final[g])
            fp32[g].unlink()
        encoder = final.get("encoder", fp32["encoder"])
        graphs = dict(encoder_path=encoder, source=source)
        diffs = check_parity(hf_model, final["decoder"], decoder_ids, name=role, **graphs)
        if head_ids is None:  # a trimmed head cannot decode the float model's continuation
            follow = [follows_float(hf_model, final["decoder"], prompt, **graphs)
                      for prompt in (decoder_ids[:1], decoder_ids)]
            parity["int8"] = {"follows_float": [n for n, _ in follow],
                              "follow_tokens": [m for _, m in follow]}
        if share_encoder:
            fp32["encoder"].unlink()
            del diffs["encoder"]
        worst = max(diffs.values())
        parity.update(max_abs_diff_int8=worst, graphs_int8=diffs,
                      verify_max_abs_diff_int8=worst * VERIFY_DIFF_FACTOR + VERIFY_DIFF_MARGIN)
    dec = model.decoder
    dims = {k: getattr(dec, k) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size")}
    dims["n_encoder_layers"] = len(model.encoder.layers)
    devices = graph_devices("portable", precision)
    graphs = {g: graph_entry(final[g], d, "portable", devices) for g, d in descs.items()
              if g in final}
    if max_batch > 1 and precision != "fp32":
        parity["lanes"] = {"none": f"no lanes graph: its {precision} MatMuls quantize a call's "
                                   f"activations as one tensor, so a lane's rows would depend "
                                   f"on the other lanes' (its steps run alone)"}
    elif max_batch > 1:
        stage(f"lanes {role}")
        graphs["decoder_lanes"], parity["lanes"] = _lanes_graph(
            model, final["decoder"], bundle_dir / f"{role}.lanes.onnx", graphs["decoder"],
            max_len=max_len, max_batch=max_batch, max_gamma=max_gamma)
    return ModelEntry(vocab_size=dec.vocab_size, graphs=graphs, precision=precision,
                      family=model.model_type, dims=dims, parity=parity)


def _lanes_graph(model, solo: Path, path: Path, decoder: GraphEntry, *, max_len: int,
                 max_batch: int, max_gamma: int) -> tuple[GraphEntry, dict]:
    """The float32 lanes graph of `model`'s decoder at `path`, checked against the decoder
    graph at `solo` (lanes_parity.seq2seq_lanes_parity): its manifest entry and parity record.
    A lane further from the decoder graph than float32 rounding allows is refused."""
    from ..graphs.export_seq2seq import export_decoder_lanes
    from ..graphs.onnx_export import graph_entry
    from ..parity.lanes_parity import judged, seq2seq_lanes_parity

    desc = export_decoder_lanes(model, path, max_len, max_batch)
    dec = model.decoder
    record = judged(seq2seq_lanes_parity(solo, path, lanes=max_batch, n_layers=dec.n_layers,
                                         max_len=max_len, max_gamma=max_gamma,
                                         vocab=dec.vocab_size,
                                         audio=getattr(model, "audio", False)),
                    precision="fp32", name=solo.stem, max_batch=max_batch)
    return graph_entry(path, desc, "portable", decoder.devices), record


def audio_entry(hf_model) -> AudioEntry | None:
    """A speech model's manifest record (manifest.AudioEntry), from its config and
    generation_config as transformers' Whisper `generate` reads them; None for a text model."""
    if not is_audio(hf_model.config):
        return None
    gen = getattr(hf_model, "generation_config", None)

    def get(key, default=None):
        value = getattr(gen, key, None) if gen is not None else None
        if value is None:
            value = getattr(hf_model.config, key, None)
        return default if value is None else value

    multilingual = bool(get("is_multilingual", bool(get("lang_to_id"))))
    languages = {k.strip("<|>"): int(v) for k, v in get("lang_to_id", {}).items()} \
        if multilingual else {}
    tasks = {k: int(v) for k, v in get("task_to_id", {}).items()} if multilingual else {}
    no_ts = get("no_timestamps_token_id")
    stamps = None  # the timestamp rules' values, where the vocabulary has timestamp tokens
    if no_ts is not None and int(no_ts) + 1 < int(hf_model.config.vocab_size):
        initial, prev = get("max_initial_timestamp_index"), get("prev_sot_token_id")
        stamps = {"max_initial_timestamp_index": None if initial is None else int(initial),
                  "prev_sot_token_id": None if prev is None else int(prev)}
    return AudioEntry(n_mels=int(hf_model.config.num_mel_bins), languages=languages,
                      tasks=tasks, no_timestamps_token_id=None if no_ts is None else int(no_ts),
                      suppress_tokens=tuple(int(t) for t in get("suppress_tokens", [])),
                      begin_suppress_tokens=tuple(int(t) for t in get("begin_suppress_tokens",
                                                                      [])),
                      timestamps=stamps)
