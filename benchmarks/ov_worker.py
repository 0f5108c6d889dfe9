"""OpenVINO GenAI for compare.py, in the Python that has it (a separate virtual environment:
benchmarks/README.md says how to make one). One process per system; compare.py sends one JSON
request per line on stdin and reads one JSON answer per line on stdout:

    {"ids": [token ids], "n": new tokens}  ->  {"tokens": [...], "wall_s": s, "info": {...}}

The prompt goes in as token ids (an ov.Tensor), so the pipeline applies no chat template of its
own; decoding is greedy; with --ignore-eos, EOS is an ordinary token as for every other system.
The wall time is the generate call's, measured here, so the pipe costs nothing.

    python ov_worker.py --model DIR [--mode plain|lookup|draft] [--draft DIR] [--f32]
                        [--threads 2] [--ignore-eos] [--lookup-tokens 8] [--ngram 3]
"""

import argparse
import json
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["plain", "lookup", "draft"], default="plain")
    ap.add_argument("--draft", help="the draft model's directory (--mode draft)")
    ap.add_argument("--f32", action="store_true",
                    help="true float32: INFERENCE_PRECISION_HINT f32, KV_CACHE_PRECISION f32 "
                         "(OpenVINO's CPU default is bf16 compute and a u8 KV cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--lookup-tokens", type=int, default=8)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=4)
    args = ap.parse_args()

    import openvino as ov
    import openvino_genai as ov_genai

    props = {"INFERENCE_NUM_THREADS": args.threads}
    if args.f32:
        props.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    kwargs = dict(props)
    if args.mode == "lookup":
        kwargs["prompt_lookup"] = True
    elif args.mode == "draft":
        kwargs["draft_model"] = ov_genai.draft_model(args.draft, "CPU", **props)
    pipe = ov_genai.LLMPipeline(args.model, "CPU", **kwargs)
    print(json.dumps({"ready": True, "openvino_genai": ov_genai.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        config = pipe.get_generation_config()
        config.max_new_tokens = request["n"]
        config.do_sample = False
        config.ignore_eos = args.ignore_eos
        if args.mode == "lookup":
            config.num_assistant_tokens = args.lookup_tokens
            config.max_ngram_size = args.ngram
        elif args.mode == "draft":
            config.num_assistant_tokens = args.draft_tokens
        ids = ov.Tensor(np.asarray([request["ids"]], dtype=np.int64))
        t0 = time.perf_counter()
        result = pipe.generate(ids, config)
        wall = time.perf_counter() - t0
        tokens = [int(t) for t in result.tokens[0]]
        print(json.dumps({"tokens": tokens[: request["n"]], "wall_s": wall, "info": {}}),
              flush=True)


if __name__ == "__main__":
    main()
