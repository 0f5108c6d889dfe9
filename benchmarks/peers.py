"""The systems `compare.py` times, behind one small interface.

Every system takes the same prompt token ids (int list) and returns exactly the new token ids it
generated, greedy, with the wall time of the whole call (prefill included):

    system.run(ids, max_new_tokens, **options) -> Run(tokens, wall_s, info)

`options` are per-call settings a sweep varies without reloading (`k`: the draft length of a
draft-model mode). `info` holds what the system reports about its own work: target_calls (every
forward call of the target model, prefill included) and, for speculative modes that say so,
accepted / proposed draft tokens.

EOS is an ordinary token for every system (none stops on it, none masks it) unless the system is
made with stop_at_eos, so all of them do the same work and their outputs can be compared token
for token. Heavy imports (torch, transformers, onnxruntime_genai, llama_cpp) happen inside the
functions that need them. The model files they run are built by model_files.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

STAND_IN_EOS = ("<empty_output>", "<|fim_pad|>")  # special tokens chat models never emit
# (the first that the vocabulary has: SmolLM2's Jupyter-data token, Qwen2.5's FIM padding)


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    info: dict = field(default_factory=dict)  # system-specific stats (acceptance, ...)


# -- systems ------------------------------------------------------------------------------------

class Draftproof:
    """spec_runtime on the bundle: target-only (use_draft=False) or speculative."""

    def __init__(self, gen, use_draft: bool, gamma, stop_at_eos: bool):
        self.gen, self.use_draft, self.gamma = gen, use_draft, gamma
        if not stop_at_eos:
            # the Generator stops on these ids; with none, EOS is an ordinary token
            gen.eos_token_ids = frozenset()

    def run(self, ids, n, **options) -> Run:
        t0 = time.perf_counter()
        r = self.gen.generate(list(ids), max_new_tokens=n, temperature=0.0,
                              gamma=options.get("k", self.gamma), use_draft=self.use_draft,
                              chat=False)
        wall = time.perf_counter() - t0
        s = r.stats
        info = {"prefill_s": s.prefill_time_s, "target_calls": s.target_calls}
        if self.use_draft:
            info.update(accepted=s.accepted, proposed=s.proposed)
        return Run(list(r.tokens), wall, info)


class CallCounter:
    """Counts a torch module's forward calls (a forward pre-hook)."""

    def __init__(self, module):
        self.calls = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1


class HFGenerate:
    """transformers `generate` in PyTorch, greedy; prompt lookup when lookup > 0; assisted
    generation with `assistant` (a draft model) otherwise. Option k: num_assistant_tokens on a
    constant schedule (without it, transformers' own default draft length and schedule). Each target forward call
    makes one token of its own plus the draft tokens it accepts, so accepted = new tokens −
    target calls; an assistant proposes one token per forward call."""

    def __init__(self, model, lookup: int, stop_at_eos: bool, eos_ids, assistant=None):
        import torch

        self.torch, self.model, self.lookup, self.assistant = torch, model, lookup, assistant
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
        self.eos = eos_ids if stop_at_eos else None
        self.pad = eos_ids[0]
        self.target_calls = getattr(model, "_call_counter", None) or CallCounter(model)
        model._call_counter = self.target_calls
        self.draft_calls = None
        if assistant is not None:
            config = assistant.generation_config
            self.assistant_defaults = (config.num_assistant_tokens,
                                       config.num_assistant_tokens_schedule)
            self.draft_calls = getattr(assistant, "_call_counter", None) or CallCounter(assistant)
            assistant._call_counter = self.draft_calls

    def run(self, ids, n, **options) -> Run:
        torch = self.torch
        x = torch.tensor([list(ids)], dtype=torch.long)
        kw = {}
        if self.lookup:
            kw["prompt_lookup_num_tokens"] = self.lookup
        elif self.assistant is not None:
            kw["assistant_model"] = self.assistant
            # transformers reads the draft length from the assistant's generation config, not
            # from generate's arguments
            config = self.assistant.generation_config
            if options.get("k"):
                config.num_assistant_tokens = int(options["k"])
                config.num_assistant_tokens_schedule = "constant"
            else:
                config.num_assistant_tokens, config.num_assistant_tokens_schedule = \
                    self.assistant_defaults
        calls0 = self.target_calls.calls
        draft0 = self.draft_calls.calls if self.draft_calls else 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=n, eos_token_id=self.eos,
                                      pad_token_id=self.pad, **kw)
        wall = time.perf_counter() - t0
        tokens = out[0, x.shape[1]:].tolist()
        info = {"target_calls": self.target_calls.calls - calls0}
        if self.lookup or self.assistant is not None:
            info["accepted"] = len(tokens) - info["target_calls"]
        if self.draft_calls is not None:
            info["proposed"] = self.draft_calls.calls - draft0
        return Run(tokens, wall, info)


def load_hf(path: Path, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class OrtGenai:
    """onnxruntime-genai's Generator loop, greedy. `spec` is a dict of speculative options for
    set_speculative_options: its n-gram mode (ngram_size, max_draft_tokens,
    ngram_chained_lookup) on a plain model, or max_draft_tokens for a model loaded with a draft
    (load_ortgenai(..., draft=DIR)); option k overrides max_draft_tokens."""

    def __init__(self, model, spec: dict | None, stop_at_eos: bool, eos_id: int):
        import onnxruntime_genai as og

        self.og, self.model, self.spec = og, model, spec
        self.stop_at_eos, self.eos_id = stop_at_eos, eos_id

    def run(self, ids, n, **options) -> Run:
        og = self.og
        spec = dict(self.spec or {})
        if options.get("k"):
            spec["max_draft_tokens"] = int(options["k"])
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + n)
        if spec:
            params.set_speculative_options(**spec)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        wall = time.perf_counter() - t0
        tokens = gen.get_sequence(0)[len(ids):].tolist()
        if self.stop_at_eos and len(tokens) < n:
            tokens.append(self.eos_id)  # genai leaves the EOS it generated out of the sequence
        info = {"target_calls": len(tokens)}  # the plain loop: one call per token
        if spec:
            st = gen.get_speculative_stats()
            # the prefill, its verify (and re-anchor) passes, and the plain steps it falls back
            # to where the n-gram lookup finds nothing
            info = {"accepted": int(st["draft_tokens_accepted"]),
                    "proposed": int(st["draft_tokens_proposed"]),
                    "target_calls": 1 + int(st["target_forward_passes"])
                    + int(st["standard_fallback_steps"])}
        return Run(tokens, wall, info)


def load_ortgenai(path: Path, threads: int, stop_at_eos: bool, draft: Path | None = None):
    """The genai model with `threads` intra-op threads, and `draft` (another genai build of the
    same vocabulary) as its draft model when given. genai reads the draft's file name relative to
    the target's directory, so it gets a relative path. Without stop_at_eos its EOS id is
    swapped for a STAND_IN_EOS token, so EOS becomes an ordinary token. (0.18 rejects ids outside
    the vocabulary, and a list given in a config overlay did not replace the EOS id;
    search.min_length would mask EOS instead, changing the greedy tokens.)"""
    import os

    import onnxruntime_genai as og
    from tokenizers import Tokenizer

    session = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    overlay = {"model": {"decoder": {"session_options": session}}}
    if draft is not None:
        decoder = json.loads((Path(draft) / "genai_config.json").read_text())["model"]["decoder"]
        decoder["filename"] = os.path.relpath(Path(draft) / decoder["filename"], path)
        decoder["session_options"] = {**decoder.get("session_options", {}), **session}
        overlay["model"]["draft"] = decoder
    if not stop_at_eos:
        vocab = Tokenizer.from_file(str(path / "tokenizer.json"))
        stand_in = next(i for i in map(vocab.token_to_id, STAND_IN_EOS) if i is not None)
        overlay["model"]["eos_token_id"] = stand_in
    config = og.Config(str(path))
    config.overlay(json.dumps(overlay))
    return og.Model(config)


class LlamaCpp:
    """llama.cpp through llama-cpp-python on a GGUF file, greedy (temp 0); its prompt-lookup
    speculative mode (LlamaPromptLookupDecoding) when `lookup` > 0. The context is reset before
    every call, so no call reuses an earlier prompt's KV (generate's own prefix reuse sees an
    empty context; prefill is always timed). Target calls are its eval calls (the prompt is one);
    the lookup's proposals are counted where it returns them, and each eval call keeps one token
    of its own, so accepted = new tokens − eval calls."""

    def __init__(self, threads: int, lookup: int, stop_at_eos: bool, eos_ids,
                 gguf: Path | None = None, n_ctx: int = 2048):
        from llama_cpp import Llama

        self.proposed = 0
        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            lookup_draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)

            def draft(input_ids, **kw):
                out = lookup_draft(input_ids, **kw)
                self.proposed += len(out)
                return out
        if gguf is None:
            from model_files import smollm2_gguf

            gguf = smollm2_gguf()
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False)
        self.calls = 0
        eval_ = self.llm.eval

        def counted(tokens):
            self.calls += 1
            return eval_(tokens)
        self.llm.eval = counted
        self.lookup = lookup
        self.stop_at_eos = stop_at_eos
        self.eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)

    def run(self, ids, n, **options) -> Run:
        self.calls = self.proposed = 0
        t0 = time.perf_counter()
        self.llm.reset()
        tokens: list[int] = []
        for tok in self.llm.generate(list(ids), top_k=1, temp=0.0, reset=True):
            tokens.append(int(tok))
            if len(tokens) >= n or (self.stop_at_eos and tok in self.eos_ids):
                break
        wall = time.perf_counter() - t0
        info = {"target_calls": self.calls}
        if self.lookup:
            info.update(proposed=self.proposed, accepted=max(0, len(tokens) - self.calls))
        return Run(tokens, wall, info)


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

    def run(self, ids, n, **options) -> Run:
        self.proc.stdin.write(json.dumps({"ids": [int(t) for t in ids], "n": n,
                                          "options": options}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return Run(answer["tokens"], answer["wall_s"], answer["info"])


def openvino_missing(python: Path | None) -> str | None:
    """Why the OpenVINO rows cannot run, or None."""
    if python is None or not Path(python).exists():
        return ("no OpenVINO environment: make one as benchmarks/README.md says and pass "
                "--openvino-python PATH/bin/python")
    return None


def llamacpp_missing() -> str | None:
    """Why llama.cpp rows cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (it compiles llama.cpp: benchmarks/README.md "
                "says how)")
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
