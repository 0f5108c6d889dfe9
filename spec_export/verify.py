"""`specexport verify`: re-check a built bundle against the models it came from."""

from __future__ import annotations

from pathlib import Path

from spec_runtime.bundle import default_bundle_dir
from spec_runtime.manifest import read_manifest

from .quality import FP32_TOLERANCE, PARITY_PROMPT, QUANT_PROMPTS
from .sources import BuildError
from .sources import ModelSpec, load_model


def verify_bundle(bundle_dir=None) -> dict:
    """sha256 of every file, then parity of each graph vs the PyTorch model it was exported
    from (loaded again from the source recorded in the manifest)."""
    bundle_dir = Path(bundle_dir) if bundle_dir else default_bundle_dir()
    manifest = read_manifest(bundle_dir, check_files=True)
    report = {"bundle": str(bundle_dir), "files": "ok", "graphs": {}}
    roles = ["target"] + (["draft"] if manifest["draft"]["kind"] == "model" else [])
    t_model, t_tok = load_model(ModelSpec(manifest["target"]["source"],
                                     manifest["target"].get("gguf_file")))
    ids = t_tok(PARITY_PROMPT)["input_ids"][:32]
    for role in roles:
        entry = manifest[role]
        model = t_model if role == "target" else load_model(ModelSpec(entry["source"],
                                                                 entry.get("gguf_file")))[0]
        for graph, diff in _parity(model, bundle_dir, entry["graphs"], manifest, ids).items():
            ok = entry["precision"] != "fp32" or diff <= FP32_TOLERANCE
            report["graphs"][f"{role}/{graph}"] = {"max_abs_diff": diff,
                                                   "precision": entry["precision"], "ok": ok}
            if not ok:
                raise BuildError(f"{role} {graph} graph differs from its PyTorch model by "
                                 f"{diff:.3g} > {FP32_TOLERANCE}: re-run `specexport build`")
        if entry["precision"] != "fp32" and manifest["architecture"] == "decoder-only":
            # quantized: top-1 agreement and mean KL vs the float model, as recorded at build
            from .parity import quantized_parity

            prompts = [t_tok(p)["input_ids"][:48] for p in QUANT_PROMPTS]
            report["graphs"][f"{role}/decoder"].update(quantized_parity(
                model, bundle_dir / entry["graphs"]["decoder"]["file"], prompts))
    return report


def _parity(model, bundle_dir: Path, graphs: dict, manifest: dict, ids) -> dict[str, float]:
    """{graph name: max |diff|} for one model's graphs."""
    from .parity import check_parity

    if manifest["architecture"] != "encoder-decoder":
        return {"decoder": check_parity(model, bundle_dir / graphs["decoder"]["file"], ids)}
    from .build_seq2seq import parity_inputs
    from .parity_seq2seq import check_parity_seq2seq

    source, decoder_ids = parity_inputs(model, ids, manifest["max_source_len"])
    return check_parity_seq2seq(model, bundle_dir / graphs["encoder"]["file"],
                                bundle_dir / graphs["decoder"]["file"], source, decoder_ids)
