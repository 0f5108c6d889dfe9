"""OpenVINO GenAI for compare.py, in the Python that has it (a separate virtual environment:
benchmarks/README.md says how to make one). One process per system, the protocol of worker.py:
one ready line, then one JSON request per line on stdin and one JSON answer per line on stdout:

    -> {"ready": true, "openvino_genai": version, "load_s": s, "peak_rss": bytes}
    {"ids": [token ids], "n": new tokens, "options": {"k": 5}}
    -> {"tokens": [...], "wall_s": s, "info": {...}, "peak_rss": bytes}

The prompt goes in as token ids (an ov.Tensor), so the pipeline applies no chat template of its
own; decoding is greedy, with the prefix cache off (GenAI's CPU default keeps it on, so a
repeated prompt would skip its prefill); with --ignore-eos, EOS is an ordinary token as for every
other system, else generation stops at --eos-ids (optimum's IR leaves the pipeline without an
EOS id: -1). Option k is num_assistant_tokens (draft and lookup modes). The wall time is the
generate call's, measured here, so the pipe costs nothing. info: target_calls (the main model's
steps, prefill included), and in draft mode accepted / proposed draft tokens (see stats).

    python ov_worker.py --model DIR [--mode plain|lookup|draft] [--draft DIR] [--f32]
                        [--draft-f32] [--threads 2] [--ignore-eos] [--eos-ids 2,3]
                        [--lookup-tokens 8] [--ngram 3] [--draft-tokens 4]
"""

import argparse
import json
import sys
import time

import numpy as np

import machine  # benchmarks/, this script's own directory

F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def stats(result, mode: str, k: int, new_tokens: int) -> dict:
    """Target calls from the pipeline's perf metrics (the main model's steps, prefill included).
    In draft mode each target call keeps one token of its own, so accepted = new tokens −
    target calls, and every verify call checks k draft tokens. (The pipeline's own counters
    miss rounds: get_num_draft_tokens() is 0 after a 4-token generation that accepted 2.)"""
    metrics = result.extended_perf_metrics if mode != "plain" else None
    main = getattr(metrics, "main_model_metrics", None) or result.perf_metrics
    info = {"target_calls": len(main.raw_metrics.m_batch_sizes)}
    if mode == "draft":
        info.update(accepted=new_tokens - info["target_calls"],
                    proposed=k * (info["target_calls"] - 1))
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["plain", "lookup", "draft"], default="plain")
    ap.add_argument("--draft", help="the draft model's directory (--mode draft)")
    ap.add_argument("--f32", action="store_true",
                    help="true float32: INFERENCE_PRECISION_HINT f32, KV_CACHE_PRECISION f32 "
                         "(OpenVINO's CPU default is bf16 compute and a u8 KV cache)")
    ap.add_argument("--draft-f32", action="store_true",
                    help="the draft at true float32 too (default: its CPU defaults, the fastest)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--eos-ids", default="", help="comma-separated EOS ids to stop at")
    ap.add_argument("--lookup-tokens", type=int, default=8)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=4)
    args = ap.parse_args()

    t0 = time.perf_counter()
    import openvino as ov
    import openvino_genai as ov_genai

    props = {"INFERENCE_NUM_THREADS": args.threads, **(F32 if args.f32 else {})}
    # GenAI's CPU default (get_latency_oriented_scheduler_config): paged attention, unlimited
    # batched tokens, and prefix caching, which would let a repeated prompt (the warm-up, a
    # second repetition) skip its prefill; the same without the prefix cache
    scheduler = ov_genai.SchedulerConfig()
    scheduler.max_num_batched_tokens = sys.maxsize
    scheduler.enable_prefix_caching = False
    kwargs = {**props, "scheduler_config": scheduler}
    if args.mode == "lookup":
        kwargs["prompt_lookup"] = True
    elif args.mode == "draft":
        draft_props = {"INFERENCE_NUM_THREADS": args.threads, **(F32 if args.draft_f32 else {})}
        kwargs["draft_model"] = ov_genai.draft_model(args.draft, "CPU", **draft_props)
    pipe = ov_genai.LLMPipeline(args.model, "CPU", **kwargs)
    eos_ids = [int(t) for t in args.eos_ids.split(",") if t]
    print(json.dumps({"ready": True, "openvino_genai": ov_genai.__version__,
                      "versions": {"openvino-genai": ov_genai.__version__},
                      "load_s": time.perf_counter() - t0, "peak_rss": machine.peak_rss()}),
          flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        k = request.get("options", {}).get("k")
        config = pipe.get_generation_config()
        config.max_new_tokens = request["n"]
        config.do_sample = False
        config.ignore_eos = args.ignore_eos
        if eos_ids and not args.ignore_eos:
            config.eos_token_id = eos_ids[0]
            config.stop_token_ids = set(eos_ids)
        if args.mode == "lookup":
            k = int(k or args.lookup_tokens)
            config.max_ngram_size = args.ngram
        elif args.mode == "draft":
            k = int(k or args.draft_tokens)
        if args.mode != "plain":
            config.num_assistant_tokens = k
        ids = ov.Tensor(np.asarray([request["ids"]], dtype=np.int64))
        t0 = time.perf_counter()
        result = pipe.generate(ids, config)
        wall = time.perf_counter() - t0
        tokens = [int(t) for t in result.tokens[0]][: request["n"]]
        print(json.dumps({"tokens": tokens, "wall_s": wall,
                          "info": stats(result, args.mode, k, len(tokens)),
                          "peak_rss": machine.peak_rss()}), flush=True)


if __name__ == "__main__":
    main()
