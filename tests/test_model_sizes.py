"""A model's sizes are checked before transformers builds it (spec_export/sources/config_sizes.py,
source_checks.py), for every family the export covers and for GGUF metadata too: a size that is
not a positive integer, or heads that do not divide, is refused by name; sizes that make far
more parameters than the saved weights hold, or more than this machine's memory, are refused
before anything is allocated. The estimate's oracle is the parameter count of the Hugging Face
model itself."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import tiny_models
from gguf_damage import patched, value_at
from helpers import assert_input_error, run

from draftproof.cli.specexport import main as specexport
from draftproof.models import ENCODER_DECODER, SUPPORTED
from spec_export.sources import config_sizes
from spec_export.sources.config_sizes import FAMILIES, check_config, with_defaults
from spec_runtime.errors import BuildError

FIX = "config.json (it must describe the saved weights)"
MAKERS = {"llama": lambda: tiny_models.llama(0), "qwen2": lambda: tiny_models.qwen2(0),
          "qwen3": lambda: tiny_models.qwen3(0), "mistral": lambda: tiny_models.mistral(0),
          "gemma3_text": lambda: tiny_models.gemma3(0), "gpt2": lambda: tiny_models.gpt2(0),
          "t5": lambda: tiny_models.t5(0), "whisper": lambda: tiny_models.whisper(0)}
TOKENIZERS = {"t5": tiny_models.t5_tokenizer, "whisper": tiny_models.whisper_tokenizer}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: a tiny model of it saved with save_pretrained}."""
    root = tmp_path_factory.mktemp("families")
    return {name: tiny_models.save(make(), root / name, TOKENIZERS[name]()
                                   if name in TOKENIZERS else None)
            for name, make in MAKERS.items()}


def edited(saved, family, tmp_path, **changes):
    """A copy of the saved `family` model whose config.json has `changes`."""
    out = tmp_path / f"{family}-edited"
    shutil.copytree(saved[family], out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_every_exported_family_has_its_sizes_checked():
    assert set(FAMILIES) == set(SUPPORTED) | set(ENCODER_DECODER)


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_the_estimate_is_the_models_own_parameter_count(family):
    """Within the norms and biases it leaves out (a few percent of a tiny model)."""
    model = MAKERS[family]()
    fields, parameters = FAMILIES[family]
    actual = sum(p.numel() for p in model.parameters())  # a tied head counted once
    estimate = parameters(with_defaults(model.config.to_dict()))
    assert 0.9 * actual <= estimate <= actual, (estimate, actual)


@pytest.mark.parametrize("family,field,value,words", [
    ("llama", "num_attention_heads", 0, "num_attention_heads 0, which must be a positive integer"),
    ("llama", "num_key_value_heads", 3, "num_attention_heads 4, not a multiple of "
                                        "num_key_value_heads 3"),
    ("llama", "num_hidden_layers", -1, "num_hidden_layers -1, which must be a positive"),
    ("llama", "intermediate_size", 0, "intermediate_size 0, which must be a positive"),
    ("llama", "vocab_size", 1e10, "vocab_size 10000000000.0, which must be a positive integer"),
    ("llama", "hidden_size", "64", "hidden_size '64', which must be a positive integer"),
    ("qwen2", "num_key_value_heads", 0, "num_key_value_heads 0, which must be"),
    ("qwen3", "num_hidden_layers", 0, "num_hidden_layers 0, which must be"),
    ("mistral", "num_attention_heads", 0, "num_attention_heads 0, which must be"),
    ("gemma3_text", "head_dim", 0, "head_dim 0, which must be"),
    ("gpt2", "n_head", 0, "n_head 0, which must be"),
    ("gpt2", "n_embd", 66, "n_embd 66, not a multiple of n_head 4"),
    ("t5", "num_heads", 0, "num_heads 0, which must be"),
    ("t5", "d_ff", None, "d_ff None, which must be a positive integer"),
    ("whisper", "num_mel_bins", 0, "num_mel_bins 0, which must be a positive integer"),
    ("whisper", "d_model", 30, "d_model 30, not a multiple of encoder_attention_heads 4"),
])
def test_a_size_that_cannot_be_is_refused_by_name(saved, tmp_path, family, field, value, words):
    src = edited(saved, family, tmp_path, **{field: value})
    r = run(specexport, "build", "--target", src, "--draft", "ngram", "--out", tmp_path / "b",
            "--quiet")
    assert_input_error(r, "--target", "config.json has", words, FIX)
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "b").exists()


def test_a_draft_models_sizes_are_checked_before_the_targets_export(saved, tmp_path):
    src = edited(saved, "llama", tmp_path, num_attention_heads=0)
    r = run(specexport, "build", "--target", saved["llama"], "--draft", src, "--out",
            tmp_path / "b", "--quiet")
    assert_input_error(r, "--draft", "num_attention_heads 0")


def test_a_config_that_does_not_describe_its_weights_is_named(saved, tmp_path):
    """A size within reason but not the weights' is refused with the first tensor that differs,
    not transformers' report table and RuntimeError."""
    src = edited(saved, "llama", tmp_path, intermediate_size=96)
    r = run(specexport, "build", "--target", src, "--draft", "ngram", "--out", tmp_path / "b",
            "--quiet")
    assert_input_error(r, "config.json does not match the saved weights", "mlp.down_proj.weight",
                       "[64, 128] in the checkpoint and [64, 96] by config.json", FIX)
    assert len(r.output.strip().splitlines()) == 1, r.output


# the address space a child may use beyond what its imports (torch, transformers, the CLI) take
HEADROOM = 2 << 30
CAP = f"""
import resource
with open("/proc/self/status") as f:
    used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (used + {HEADROOM}, used + {HEADROOM}))
"""


def test_huge_sizes_are_refused_at_once_in_bounded_memory(saved, tmp_path):
    """Each case in one child process whose address space is capped at 2 GiB beyond what its
    imports take (RLIMIT_AS): loading these used to build a million layers (minutes,
    gigabytes) or allocate terabytes before failing."""
    gguf = tiny_models.write_gguf(tiny_models.llama(5, layers=2, hidden=128),
                                  tiny_models.byte_tokenizer(), tmp_path / "tiny.gguf")
    cases = {  # target -> what the refusal names
        edited(saved, "llama", tmp_path / "a", num_hidden_layers=10**6):
            "num_hidden_layers 1000000",
        edited(saved, "llama", tmp_path / "b", hidden_size=1 << 20): "hidden_size 1048576",
        edited(saved, "llama", tmp_path / "c", vocab_size=10**10): "vocab_size 10000000000",
        edited(saved, "gpt2", tmp_path / "d", n_layer=10**6): "n_layer 1000000",
        edited(saved, "t5", tmp_path / "e", num_layers=10**6): "num_layers 1000000",
        edited(saved, "gemma3_text", tmp_path / "f", num_hidden_layers=10**6,
               layer_types=None): "num_hidden_layers 1000000",
        patched(gguf, tmp_path / "blocks.gguf", value_at(gguf, "llama.block_count"), "I",
                10**6): "block_count 1000000",
        patched(gguf, tmp_path / "embd.gguf", value_at(gguf, "llama.embedding_length"), "I",
                1 << 20): "llama.embedding_length 1048576",
        patched(gguf, tmp_path / "heads.gguf", value_at(gguf, "llama.attention.head_count"),
                "I", 0): "llama.attention.head_count 0",
    }
    code = textwrap.dedent("""
        import json, sys
        import torch, transformers
        from click.testing import CliRunner
        from draftproof.cli.specexport import main
    """) + CAP + textwrap.dedent(f"""
        out = {{}}
        for i, target in enumerate(json.loads(sys.argv[1])):
            r = CliRunner().invoke(main, ["build", "--target", target, "--draft", "ngram",
                                          "--out", f"{tmp_path}/out{{i}}", "--quiet"])
            out[target] = [r.exit_code, r.output]
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", code, json.dumps([str(t) for t in cases])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for target, words in cases.items():
        code, output = results[str(target)]
        assert code == 2 and "Traceback" not in output, (target, output)
        assert words in output and len(output.strip().splitlines()) == 1, (target, output)
        assert "parameters" in output or "block_count" in output or "which must be" in output


def test_a_model_larger_than_the_memory_is_refused_with_both_sizes(monkeypatch):
    config = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "vocab_size": 128256}
    monkeypatch.setattr(config_sizes, "available_memory",
                        lambda: (8 * 10**9, "this machine has available"))
    with pytest.raises(BuildError) as e:
        check_config(config, "--target 'x'", "config.json", FIX)
    # Llama 3 8B: 8,030,261,248 parameters, less 266,240 of norms
    assert "8,029,995,008 parameters, 32.1 GB in float32" in str(e.value)
    assert "this machine has available 8 GB" in str(e.value)
    monkeypatch.setattr(config_sizes, "available_memory",
                        lambda: (40 * 10**9, "this machine has available"))
    assert check_config(config, "--target 'x'", "config.json", FIX) == 8_029_995_008


def test_the_memory_available_is_bounded_by_an_address_space_limit():
    code = "from spec_export.sources.config_sizes import available_memory\n" + CAP + \
        "print(available_memory()[0])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 0 < int(r.stdout) <= HEADROOM, r.stdout + r.stderr


def test_a_ggufs_sizes_are_read_as_transformers_reads_them(tmp_path):
    """The sizes come from the checked layout (gguf-py's reader takes seconds over a real
    vocabulary); transformers' own GGUF config reading is the oracle."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from spec_export.sources.gguf_check import read_layout
    from spec_export.sources.source_checks import _gguf_config

    for name, tied in (("tied", True), ("untied", False)):
        path = tiny_models.write_gguf(tiny_models.llama(5, layers=3, hidden=128, tied=tied),
                                      tiny_models.byte_tokenizer(), tmp_path / f"{name}.gguf")
        ours, keys = _gguf_config(read_layout(path))
        theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        assert ours == {k: theirs[k] for k in ours}, name
        assert {"num_hidden_layers", "hidden_size", "vocab_size", "head_dim"} <= set(ours)
        assert keys["num_hidden_layers"] == "llama.block_count"
