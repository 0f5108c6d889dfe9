"""`specexport verify`: re-check a built bundle against the models it came from.

Every file's sha256 (and everything `spec_runtime.load` checks of the manifest), then every
graph against its PyTorch model, loaded again from the source the manifest records:
- a float32 graph: max |logits - PyTorch's| over prefill, steps, verify calls and a rollback
  (parity.check_parity) within FP32_TOLERANCE;
- a quantized decoder graph: top-1 agreement and mean KL with the float model over
  QUANT_PROMPTS, against the thresholds the build recorded from its own measurement (older
  bundles: only the "broken" rule the build applies);
- an int8 encoder-decoder graph: max |diff| within the recorded limit.
A graph that fails raises BundleError: the bundle does not hold the model it says it does.
"""

from __future__ import annotations

from pathlib import Path

from spec_runtime.bundle import default_bundle_dir
from spec_runtime.errors import BundleError
from spec_runtime.manifest import Manifest, ModelEntry, read_manifest

from .quality import FP32_TOLERANCE, PARITY_PROMPT, QUANT_PROMPTS, broken_quantization
from .sources import ModelSpec, load_model


def verify_bundle(bundle_dir=None) -> dict:
    bundle_dir = Path(bundle_dir) if bundle_dir else default_bundle_dir()
    manifest = read_manifest(bundle_dir, check_files=True)
    report = {"bundle": str(bundle_dir), "files": "ok", "graphs": {}}
    t_model, t_tok = load_model(ModelSpec(manifest.target.source, manifest.target.gguf_file))
    ids = t_tok(PARITY_PROMPT)["input_ids"][:32]
    for role, entry in manifest.models():
        model = t_model if role == "target" else \
            load_model(ModelSpec(entry.source, entry.gguf_file))[0]
        for graph, diff in _parity(model, bundle_dir, entry, manifest, ids).items():
            row = {"precision": entry.precision, "max_abs_diff": diff}
            report["graphs"][f"{role}/{graph}"] = row
            if entry.precision == "fp32":
                row.update(limit=FP32_TOLERANCE, ok=diff <= FP32_TOLERANCE)
            elif manifest.encoder_decoder:
                limit = (entry.parity or {}).get("verify_max_abs_diff_int8")
                row.update(limit=limit, ok=limit is None or diff <= limit)
            if row.get("ok") is False:
                raise BundleError(f"{role} {graph} graph differs from its PyTorch model by "
                                  f"{diff:.3g} > {row['limit']:.3g}: it is not the model the "
                                  f"manifest names; re-run `specexport build`")
        if entry.precision != "fp32" and not manifest.encoder_decoder:
            _check_quantized(report["graphs"][f"{role}/decoder"], role, entry, model, bundle_dir,
                             [t_tok(p)["input_ids"][:48] for p in QUANT_PROMPTS])
    return report


def _check_quantized(row: dict, role: str, entry: ModelEntry, model, bundle_dir: Path,
                     prompts) -> None:
    """A quantized graph's logits differ from the float model's by design; it is judged by how
    often it picks the same next token and how far its distribution moves (KL)."""
    from .parity import quantized_parity

    measured = quantized_parity(model, bundle_dir / entry.graphs["decoder"].file, prompts)
    limits = ((entry.parity or {}).get(entry.precision) or {}).get("verify_thresholds")
    row.update(measured, thresholds=limits)
    if limits is None:
        row["ok"] = not broken_quantization(measured)
    else:
        row["ok"] = (measured["top1_agreement"] >= limits["min_top1_agreement"]
                     and measured["mean_kl"] <= limits["max_mean_kl"])
    if not row["ok"]:
        want = (f"the build measured it within top-1 >= {limits['min_top1_agreement']:.2f}, "
                f"KL <= {limits['max_mean_kl']:.3f}" if limits else "a working graph agrees far "
                "more")
        raise BundleError(f"{role} {entry.precision} graph agrees with the float model on "
                          f"{measured['top1_agreement']:.0%} of next tokens (mean KL "
                          f"{measured['mean_kl']:.3f}), and {want}: its weights are not the "
                          f"model's; re-run `specexport build`")


def _parity(model, bundle_dir: Path, entry: ModelEntry, manifest: Manifest,
            ids) -> dict[str, float]:
    """{graph name: max |diff|} for one model's graphs."""
    from .parity import check_parity

    graphs = entry.graphs
    if not manifest.encoder_decoder:
        return {"decoder": check_parity(model, bundle_dir / graphs["decoder"].file, ids)}
    from .build_seq2seq import parity_inputs
    from .parity_seq2seq import check_parity_seq2seq

    source, decoder_ids = parity_inputs(model, ids, manifest.max_source_len)
    return check_parity_seq2seq(model, bundle_dir / graphs["encoder"].file,
                                bundle_dir / graphs["decoder"].file, source, decoder_ids)
