"""How a GGUF's own blocks fare as MatMulNBits weights, per block type, on the real files.

1. Every 2-D tensor of the file: its blocks as spec_export/quantization/gguf_quants.py reads them
   de-quantize to gguf-py's floats bit for bit (transformers loads those), also with the zero
   points centred; and the share of 32-blocks whose zero point could be centred.
2. Per block type, on up to --tensors layer tensors: the relative error ‖y − y_ref‖ / ‖y_ref‖
   of one MatMul's output over 8 rows of Gaussian inputs, y_ref = x·Wᵀ in float64 from
   gguf-py's weights, for
     blocks        the int4 build's graph (spec_export/quantization/gguf_blocks.py: MatMulNBits at
                   accuracy level 4, offsets as a float MatMul over block sums, zero points
                   centred),
     uncentred     the same with the file's own zero points (offset types only),
     folded        the offsets rounded into the zero points (codes and scales kept, no
                   offset MatMul): what dropping the float term would cost (offset types only),
     re-quantized  `--int4-weights quantize`: MatMulNBitsQuantizer, 4-bit, symmetric, block 32.
   What the blocks leave is the 8-bit activations' rounding; re-quantizing adds a second
   rounding of every weight.

    python benchmarks/gguf_block_error.py qwen-0.5b gemma3-270m [--tensors 3] [--report DIR]

--report DIR also writes the dated report (reports.py: these tables and a plot of each
tensor's error by method, log scale) into DIR.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402  (benchmarks/ is not a package)
import reports  # noqa: E402


def one_matmul(k: int, n: int, weight: np.ndarray | None = None, blocks=None):
    """An ONNX model y = x·Wᵀ over x [1, rows, k]: a float MatMul (`weight` [n, k]) or the
    int4 build's rewrite of `blocks`."""
    from onnx import TensorProto, helper, numpy_helper

    from spec_export.quantization.gguf_blocks import _Writer

    if blocks is not None:
        w = _Writer()
        w.matmul("x", blocks, w.blocks(blocks, "w"), "y", "mm")
        nodes, inits = w.nodes, w.inits
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
        inits = [numpy_helper.from_array(np.ascontiguousarray(weight.T), "w")]
    graph = helper.make_graph(nodes, "one", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, None, k])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, None, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def run(model, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x[None]})[0][0].astype(np.float64)


def folded(b):
    """`b` with each 32-block's offset rounded into its zero point: scale·(code − zp) + offset
    = scale·(code − (zp − offset/scale)), zp − offset/scale rounded to a code (and clipped to
    the code range). Lossy: the weights move by up to half a step a block, all the same way."""
    from spec_export.quantization.gguf_quants import Blocks

    scales = np.where(b.scales == 0, 1, b.scales)
    real = b.zero_points.astype(np.float64) - b.offsets.astype(np.float64) / scales
    zp = np.clip(np.rint(real), 0, (1 << b.bits) - 1).astype(np.uint8)
    return Blocks(b.kind, b.codes, b.scales, b.bits, b.block, zp, None)


def requantized(weight: np.ndarray):
    import onnx

    from spec_export.quantization.quantize import quantize_int4

    with tempfile.TemporaryDirectory(prefix="gguf-blocks-") as tmp:
        path = Path(tmp) / "q.onnx"
        quantize_int4(None, path, 32, model=one_matmul(weight.shape[1], weight.shape[0], weight))
        return onnx.load(str(path))


def measure(path: Path, per_type: int) -> dict:
    """Prints the file's two tables as it measures; returns {"file", "lines" (the tables'
    markdown), "errors" (a row per tensor measured)}."""
    import gguf

    from spec_export.quantization.gguf_quants import _tensor_rows, parse

    exact, centred, blocks = defaultdict(lambda: [0, 0]), defaultdict(int), defaultdict(int)
    layer_tensors = defaultdict(list)
    for t in gguf.GGUFReader(str(path)).tensors:
        raw = _tensor_rows(t)
        if raw is None:
            continue
        kind, same = t.tensor_type.name, True
        for at in range(0, len(raw), 4096):  # rows at a time: a vocabulary-sized head is 1 GB
            rows = raw[at : at + 4096]
            want = gguf.quants.dequantize(rows, t.tensor_type).reshape(len(rows), -1)
            b = parse(kind, rows)
            c = b.centred()
            same &= np.array_equal(b.weights().view(np.uint32), want.view(np.uint32)) \
                and np.array_equal(c.weights(), want)
            if b.offsets is not None:
                centred[kind] += int((c.zero_points != b.zero_points).sum())
                blocks[kind] += b.zero_points.size
        exact[kind][0] += same
        exact[kind][1] += 1
        if t.name.startswith("blk."):
            layer_tensors[kind].append(t)
    lines, errors = [], []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
    say(f"\n{path.name}\n")  # a paragraph of its own: the table below renders as one
    say("| type | tensors read bit for bit | 32-blocks centred |")
    say("|---|---:|---:|")
    for kind, (ok, total) in sorted(exact.items()):
        share = f"{centred[kind] / blocks[kind]:.4%}" if blocks[kind] else "n/a (symmetric)"
        say(f"| {kind} | {ok}/{total} | {share} |")

    say("\n| type | tensor [N×K] | blocks | uncentred | folded | re-quantized int4 |")
    say("|---|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for kind, tensors in sorted(layer_tensors.items()):
        step = max(1, len(tensors) // per_type)
        for t in tensors[::step][:per_type]:
            raw = _tensor_rows(t)
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(len(raw), -1)
            n, k = w.shape
            x = rng.standard_normal((8, k)).astype(np.float32)
            ref = x.astype(np.float64) @ w.T.astype(np.float64)

            def err(model, x=x, ref=ref):
                return np.linalg.norm(run(model, x) - ref) / np.linalg.norm(ref)

            b = parse(kind, raw)
            offsets = b.offsets is not None
            row = {"type": kind, "tensor": t.name, "shape": [n, k],
                   "blocks": err(one_matmul(k, n, blocks=b.centred())),
                   "uncentred": err(one_matmul(k, n, blocks=b)) if offsets else None,
                   "folded": err(one_matmul(k, n, blocks=folded(b))) if offsets else None,
                   "re-quantized": err(requantized(w))}
            errors.append(row)
            say(f"| {kind} | {t.name} [{n}×{k}] | {row['blocks']:.2e} | "
                + " | ".join("" if row[c] is None else f"{row[c]:.2e}"
                             for c in ("uncentred", "folded", "re-quantized")) + " |")
    return {"file": path.name, "lines": lines, "errors": errors}


METHODS = ("blocks", "uncentred", "folded", "re-quantized")


def plot(measured: list[dict]):
    """Per file: each measured tensor's relative error by method (log scale)."""
    fig, axes = reports.figure(len(measured), 1, size=(10, 3.8 * len(measured)))
    if fig is None:
        return None
    for ax, m in zip(axes[:, 0], measured):
        names = [f"{r['type']} {r['tensor'].removeprefix('blk.')}" for r in m["errors"]]
        reports.bars(ax, names, {c: [r[c] for r in m["errors"]] for c in METHODS},
                     ylabel="‖y − y_ref‖ / ‖y_ref‖", rotate=True,
                     title=f"{m['file']}: one MatMul's relative error by weights")
        ax.set_yscale("log")
    return fig


def main(argv=None) -> None:
    from real_models import MODELS, fetch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=["qwen-0.5b", "gemma3-270m"], choices=list(MODELS))
    ap.add_argument("--tensors", type=int, default=3, help="layer tensors measured per type")
    reports.add_options(ap, default="none", from_json=False)
    args = ap.parse_args(argv)
    import onnxruntime

    title = "GGUF blocks as int4-build weights, per block type (benchmarks/gguf_block_error.py)"
    head = [f"- `python benchmarks/gguf_block_error.py {' '.join(args.models)} "
            f"--tensors {args.tensors}`, onnxruntime {onnxruntime.__version__}, "
            "MatMulNBits accuracy level 4 on CPU",
            "- relative error ‖y − y_ref‖/‖y_ref‖ of x·Wᵀ over 8 Gaussian rows, y_ref in "
            "float64 from gguf-py's weights"]
    print(f"# {title}\n")
    print("\n".join(head))
    measured = [measure(fetch(name), args.tensors) for name in args.models]
    directory = reports.directory(args)
    if directory is not None:
        reports.done(reports.write_report(
            directory, "gguf-blocks", title=title, command=reports.command_line(),
            machine=machine.describe(machine.info(threads=0)),
            sections=["\n".join(head)] + ["\n".join(m["lines"]) for m in measured],
            figure=plot(measured)))


if __name__ == "__main__":
    main()
