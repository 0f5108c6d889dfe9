"""The build's options are declared once (spec_export/bundle/options.py, BuildOptions): `specexport
build`'s options are made from its fields, the library refuses a bad value in the field's name
and the command line says the same thing in its flags."""

import dataclasses
from enum import Enum

import pytest
from helpers import assert_input_error, run

from draftproof.cli.specexport import main as specexport
from spec_export.build import build_bundle
from spec_export.bundle.options import (BUILD_FIELDS, BuildOptions, DraftKind, Int4Weights, Kernels,
                                 OptionError, Precision)
from spec_runtime.errors import BuildError, FieldError

BAD = [  # field, value, the start of the library's message, the command line's
    ("max_len", 8, "max_len=8 is invalid", "--max-len 8 is invalid"),
    ("max_source_len", 0, "max_source_len=0 is invalid", "--max-source-len 0 is invalid"),
    ("gamma", "fast", "gamma='fast' is invalid", "--gamma 'fast' is invalid"),
    ("max_gamma", 0, "max_gamma=0 is invalid", "--max-gamma 0 is invalid"),
    ("prefill_chunk", 0, "prefill_chunk=0 is invalid", "--prefill-chunk 0 is invalid"),
    ("block_size", 33, "block_size=33 is invalid", "--block-size 33 is invalid"),
    ("max_batch", 65, "max_batch=65 is invalid", "--max-batch 65 is invalid"),
    ("draft_vocab", 0, "draft_vocab=0 is invalid", "--draft-vocab 0 is invalid"),
]


def test_every_field_is_an_option_of_specexport_build_with_its_help_and_default():
    build = specexport.commands["build"]
    params = {p.name: p for p in build.params}
    assert set(params) == {f.name for f in BUILD_FIELDS} | {"quiet"}
    for f in BUILD_FIELDS:
        p, m = params[f.name], f.metadata
        assert p.opts == ["--" + f.name.replace("_", "-")]
        assert p.help.startswith(m["what"]), f.name
        default = f.default.value if isinstance(f.default, Enum) else f.default
        assert p.default == default, f.name
        if m["default"]:  # the default in words, where the value alone does not say it
            assert p.help.endswith(f"[default: {m['default']}]")
    choices = {name: set(params[name].type.choices) for name in ("precision", "kernels",
                                                                 "int4_weights")}
    assert choices == {"precision": {"fp32", "fp16", "int8", "int4"},
                       "kernels": {"auto", "fused", "portable"},
                       "int4_weights": {"auto", "gguf", "gguf-4bit", "quantize"}}


@pytest.mark.parametrize("name,value,library,cli", BAD)
def test_a_bad_value_is_refused_in_field_names_by_the_library_and_in_flags_by_the_cli(
        name, value, library, cli, tmp_path):
    with pytest.raises(OptionError) as e:
        BuildOptions(**{name: value})
    assert str(e.value).startswith(library) and e.value.field == name
    assert isinstance(e.value, BuildError) and isinstance(e.value, FieldError)
    with pytest.raises(OptionError, match="^" + library):
        build_bundle(out=tmp_path / "b", progress=False, **{name: value})
    r = run(specexport, "build", "--" + name.replace("_", "-"), str(value),
            "--out", tmp_path / "b", "--quiet")
    assert_input_error(r, "Error: " + cli)
    assert "_" not in r.output.split(" is invalid")[0]
    assert not (tmp_path / "b").exists()


def test_options_that_do_not_go_together_name_each_other():
    with pytest.raises(OptionError, match=r"^gamma=9 exceeds max_gamma=8: raise max_gamma$"):
        BuildOptions(gamma=9, max_gamma=8)
    with pytest.raises(OptionError, match=r"^max_gamma=16 leaves no room .* max_len=16"):
        BuildOptions(max_len=16, max_gamma=16)
    r = run(specexport, "build", "--gamma", "9", "--max-gamma", "8", "--out", "unused")
    assert_input_error(r, "Error: --gamma 9 exceeds --max-gamma 8: raise --max-gamma\n")
    r = run(specexport, "build", "--max-len", "16", "--max-gamma", "16", "--out", "unused")
    assert_input_error(r, "--max-gamma 16 leaves no room in a cache of --max-len 16: lower "
                          "--max-gamma or raise --max-len")


def test_choices_are_enums_parsed_once():
    o = BuildOptions(precision="int4", kernels="fused", int4_weights="gguf-4bit", gamma="auto")
    assert o.precision is Precision.INT4 and o.kernels is Kernels.FUSED
    assert o.int4_weights is Int4Weights.GGUF_4BIT and o.int4_weights.from_gguf
    assert not Int4Weights.QUANTIZE.from_gguf and o.gamma == "auto"
    assert o.precision == "int4" and f"{o.precision}" == "int4"  # a member is its spelling
    assert BuildOptions(gamma="5").gamma == 5  # the command line's spelling of a number
    assert [DraftKind.of(d) for d in ("self", "ngram", "org/model", "auto")] == \
        [DraftKind.SELF, DraftKind.NGRAM, None, DraftKind.AUTO]
    with pytest.raises(OptionError, match=r"^precision='int3' is not supported: use fp32, "
                                          r"fp16, int8 or int4$"):
        BuildOptions(precision="int3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.precision = Precision.FP32


def test_build_bundle_takes_options_values_and_where(tmp_path):
    with pytest.raises(OptionError, match="^colour is not a build option"):
        build_bundle(colour="red")
    with pytest.raises(TypeError, match="target twice"):
        build_bundle("a", target="b")
    with pytest.raises(TypeError, match="at most 3"):
        build_bundle("a", "b", "c", "d")
    base = BuildOptions(max_gamma=4)
    # values replace the options' fields, and the whole is checked again
    with pytest.raises(OptionError, match="^gamma=6 exceeds max_gamma=4"):
        build_bundle(options=base, gamma=6, out=tmp_path / "b", progress=False)


@pytest.mark.parametrize("flags,said", [
    (["--precision", "int4"], "--precision 'int4' is supported for decoder-only models"),
    (["--precision", "fp16"], "--precision 'fp16' is not offered for T5"),
    (["--kernels", "fused"], "--kernels 'fused' covers decoder-only models"),
])
def test_what_an_encoder_decoder_bundle_does_not_offer_is_said_in_flags(flags, said, tmp_path):
    """Refused once the target is loaded, before anything is exported."""
    from tiny_models import save, t5, t5_tokenizer

    target = save(t5(0, layers=1), tmp_path / "t5", t5_tokenizer())
    r = run(specexport, "build", "--target", target, "--draft", "ngram", *flags,
            "--out", tmp_path / "b", "--quiet")
    assert_input_error(r, "Error: " + said)
    assert "precision=" not in r.output and "kernels=" not in r.output
    assert not (tmp_path / "b").exists()
