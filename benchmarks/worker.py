"""One system of the pair race in a process of its own, so that its peak RSS is its own and
its threads meet no other system's. compare.py --pair starts it with a JSON spec, reads one
ready line, then sends one request per line and reads one answer per line:

    python worker.py SPEC_JSON
    -> {"ready": true, "load_s": s, "peak_rss": bytes, "versions": {...}}
    {"ids": [token ids], "n": new tokens, "options": {"k": 5}}
    -> {"tokens": [...], "wall_s": s, "info": {...}, "peak_rss": bytes}

SPEC_JSON kinds (every one has "threads" and "stop_at_eos"):
    {"kind": "draftproof", "bundle": DIR, "use_draft": bool, "gamma": null | int | "auto"}
    {"kind": "hf", "model": DIR, "assistant": DIR | null, "lookup": int, "eos_ids": [...]}
    {"kind": "ortgenai", "model": DIR, "draft": DIR | null, "spec": {...} | null, "eos_id": int}
    {"kind": "llamacpp", "gguf": FILE, "lookup": int, "eos_ids": [...]}
    {"kind": "llama-server", "binary": FILE, "gguf": FILE, "draft": FILE | null,
     "n_max": int | null, "p_min": float | null, "spec_type": str | null}

The wall time is measured here around the system's own call; the pipe costs nothing. peak_rss
is this process's own peak RSS (VmHWM): weights, caches and runtime, everything the system
needs (llama-server's: the server process's). (The OpenVINO systems run in ov_worker.py, in their own environment, with the same
protocol.)
"""

from __future__ import annotations

import json
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine
import peers

VERSIONS = {"draftproof": ("draftproof", "onnxruntime"), "hf": ("torch", "transformers"),
            "ortgenai": ("onnxruntime-genai",), "llamacpp": ("llama-cpp-python",)}


def build(spec: dict):
    """The system a spec describes, loaded."""
    kind, threads, stop = spec["kind"], spec["threads"], spec["stop_at_eos"]
    if kind == "draftproof":
        import spec_runtime

        gen = spec_runtime.load(spec["bundle"], threads=threads)
        return peers.Draftproof(gen, spec["use_draft"], spec.get("gamma"), stop)
    if kind == "hf":
        model = peers.load_hf(Path(spec["model"]), threads)
        assistant = peers.load_hf(Path(spec["assistant"]), threads) if spec.get("assistant") \
            else None
        return peers.HFGenerate(model, spec.get("lookup", 0), stop, spec["eos_ids"], assistant)
    if kind == "ortgenai":
        draft = Path(spec["draft"]) if spec.get("draft") else None
        model = peers.load_ortgenai(Path(spec["model"]), threads, stop, draft)
        return peers.OrtGenai(model, spec.get("spec"), stop, spec["eos_id"])
    if kind == "llamacpp":
        return peers.LlamaCpp(threads, spec.get("lookup", 0), stop, spec["eos_ids"],
                              Path(spec["gguf"]))
    if kind == "llama-server":
        import llama_server

        draft = Path(spec["draft"]) if spec.get("draft") else None
        return llama_server.LlamaServer(Path(spec["binary"]), Path(spec["gguf"]), threads, stop,
                                        draft, spec.get("n_max"), spec.get("p_min"),
                                        spec.get("spec_type"))
    raise SystemExit(f"unknown system kind {kind!r}")


def versions(kind: str, system) -> dict:
    if kind == "llama-server":
        return {"llama.cpp": system.version()}
    out = {}
    for pkg in VERSIONS.get(kind, ()):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    system = build(spec)
    peak_rss = getattr(system, "peak_rss", machine.peak_rss)  # a server's: its own process's
    try:
        print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0,
                          "peak_rss": peak_rss(), "versions": versions(spec["kind"], system)}),
              flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            run = system.run(request["ids"], request["n"], **request.get("options", {}))
            print(json.dumps({"tokens": [int(t) for t in run.tokens], "wall_s": run.wall_s,
                              "info": run.info, "peak_rss": peak_rss()}), flush=True)
    finally:
        getattr(system, "close", lambda: None)()


if __name__ == "__main__":
    main()
