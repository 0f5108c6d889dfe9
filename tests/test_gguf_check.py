"""A damaged GGUF is refused in one line before any library reads it
(spec_export/sources/gguf_check.py): cut short anywhere in its header, key-values, tensor infos
or data; with a count, a dimension count or an array length no file could hold; or with a tensor
whose type id was changed, so that its bytes are not its type's. gguf-py's own reader is the oracle for where each part of
the file lies and what was patched."""

import re
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from gguf_damage import n_dims_at, patched, truncated, type_id_at, value_at
from helpers import assert_input_error, run
from tiny_models import byte_tokenizer, llama, write_gguf

from draftproof.cli.specexport import main as specexport
from spec_export.sources.gguf_check import GGUFDamaged, read_layout

DOWNLOAD = "the file is damaged or not a GGUF file: download it again"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Q4_1 llama GGUF (embedding Q8_0, norms F32)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(llama(5, layers=2, hidden=128), byte_tokenizer(), path)


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    """A tiny Q4_K llama GGUF (K-quant rows are 256 wide)."""
    path = tmp_path_factory.mktemp("gguf") / "kquant.gguf"
    return write_gguf(llama(5, layers=2, hidden=256), byte_tokenizer(), path, qtype="Q4_K")


def aligned(path):
    """A one-tensor GGUF that states its alignment (general.alignment 32)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(32)
    w.add_tensor("t", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sections(path):
    """[(start, end, what the message calls it)] of the file's metadata, from gguf-py."""
    reader = gguf.GGUFReader(str(path))
    kv = [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    out = [(0, 24, "the header")]
    out += [(int(f.offset), int(f.offset) + sum(int(p.nbytes) for p in f.parts),
             f"key-value {i} (of {len(kv)})") for i, f in enumerate(kv)]
    infos = [t.field for t in reader.tensors]
    out += [(int(f.offset), int(f.offset) + sum(int(p.nbytes) for p in f.parts),
             f"tensor info {i} (of {len(infos)})") for i, f in enumerate(infos)]
    return out, int(reader.data_offset)


def test_a_valid_file_reads_as_gguf_py_reads_it(tiny):
    layout = read_layout(tiny)
    reader = gguf.GGUFReader(str(tiny))
    assert layout.data_start == reader.data_offset
    assert [(t.name, t.shape, t.type_name, layout.data_start + t.offset) for t in layout.tensors] \
        == [(t.name, tuple(int(d) for d in t.shape), t.tensor_type.name, int(t.data_offset))
            for t in reader.tensors]
    assert layout.metadata["llama.block_count"] == 2 and layout.blocks() == {0, 1}


def test_every_cut_is_refused_naming_where_the_file_stops(tiny):
    """Every length up to the data section (and cuts across the data): refused, and where a
    section is named it is the one gguf-py's reader places that byte in."""
    parts, data_start = sections(tiny)
    size = tiny.stat().st_size
    cut = tiny.with_name("cut.gguf")
    for n in [*range(0, data_start + 1), *range(data_start + 1, size, 997), size - 1]:
        with pytest.raises(GGUFDamaged) as e:
            read_layout(truncated(tiny, cut, n))
        message = str(e.value)
        assert f"at byte {n}" in message or n < 4, (n, message)
        if "declares" in message or "magic" in message:
            assert n < data_start, (n, message)  # counts past what is left: refused at once
            continue
        named = re.search(r"the header|key-value \d+ \(of \d+\)|tensor info \d+ \(of \d+\)",
                          message)
        containing = [what for start, end, what in parts if start <= n < end]
        assert (named and named.group(0)) == (containing[0] if containing else None), \
            (n, message, containing)


@pytest.mark.parametrize("option", ["--target", "--draft-model"])
@pytest.mark.parametrize("where", ["header", "key-value", "tensor info", "data"])
def test_a_cut_file_stops_the_build_in_one_line(tiny, tmp_path, option, where):
    parts, data_start = sections(tiny)
    n = {"header": 20, "key-value": (parts[17][0] + parts[17][1]) // 2,
         "tensor info": (parts[-3][0] + parts[-3][1]) // 2,
         "data": (data_start + tiny.stat().st_size) // 2}[where]
    bad = truncated(tiny, tmp_path / "cut.gguf", n)
    args = ["--target", bad] if option == "--target" else \
        ["--target", tiny, "--draft", "hybrid", "--draft-model", bad]
    r = run(specexport, "build", *args, "--out", tmp_path / "b", "--quiet")
    assert_input_error(r, option, "cut.gguf", f"at byte {n}", DOWNLOAD)
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("field,fmt,value,words", [
    ("n_dims", "I", 1 << 30, "has 1073741824 dimensions; GGUF tensors have at most 4"),
    ("n_dims", "I", 5, "has 5 dimensions"),
    ("tokens", "Q", 1 << 60, "an array of 1152921504606846976 items needs"),
    ("tokens", "Q", 10**6, "an array of 1000000 items"),
    ("tensor_count", "Q", 1 << 62, "declares 4611686018427387904 tensors"),
    ("kv_count", "Q", 1 << 40, "declares 1099511627776 key-value pairs"),
    ("key_length", "Q", 1 << 60, "is 1152921504606846976 bytes long"),
    ("type", "I", 99, "unknown type id 99"),
    ("alignment", "I", 24, "general.alignment 24 is not a power of two"),
])
def test_counts_no_file_could_hold_are_refused_in_bounded_memory(tiny, tmp_path, field, fmt,
                                                                  value, words):
    """Run in a process whose address space is capped at 256 MiB beyond what its imports take
    (RLIMIT_AS): a reader that believed these counts would allocate far more."""
    at = {"n_dims": lambda: n_dims_at(tiny, "blk.0.attn_q.weight"),
          "tokens": lambda: value_at(tiny, "tokenizer.ggml.tokens"),
          "tensor_count": lambda: 8, "kv_count": lambda: 16,
          "key_length": lambda: int(gguf.GGUFReader(str(tiny)).fields["general.name"].offset),
          "type": lambda: type_id_at(tiny, "blk.0.attn_k.weight"),
          "alignment": lambda: 0}[field]()
    src = tiny
    if field == "alignment":  # a file that has the key: one written with it
        src = aligned(tmp_path / "aligned.gguf")
        at = value_at(src, "general.alignment")
    bad = patched(src, tmp_path / "bad.gguf", at, fmt, value)
    code = textwrap.dedent(f"""
        import resource
        import gguf
        from spec_export.sources.gguf_check import GGUFDamaged, read_layout
        with open("/proc/self/status") as f:
            used = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), used + (256 << 20)))
        try:
            read_layout({str(bad)!r})
        except GGUFDamaged as e:
            print("refused:", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "refused:" in r.stdout, r.stdout + r.stderr
    assert words in r.stdout, r.stdout


@pytest.mark.parametrize("fixture,tensor,to", [
    ("tiny", "blk.0.attn_q.weight", "F32"),  # Q4_1 -> F32: 6.4 times the bytes
    ("tiny", "blk.1.ffn_down.weight", "Q4_0"),  # Q4_1 -> Q4_0: 18 bytes a block instead of 20
    ("kquant", "blk.0.ffn_down.weight", "Q6_K"),  # Q4_K -> Q6_K: more bytes
    ("kquant", "blk.1.attn_q.weight", "Q2_K"),  # Q4_K -> Q2_K: fewer bytes
    ("tiny", "output_norm.weight", "Q8_0"),  # the last tensor: F32 -> Q8_0, short of the end
])
def test_a_changed_type_id_is_named_with_its_tensor(request, tmp_path, fixture, tensor, to):
    src = request.getfixturevalue(fixture)
    was = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == tensor).tensor_type
    bad = patched(src, tmp_path / "retyped.gguf", type_id_at(src, tensor), "I",
                  gguf.GGMLQuantizationType[to].value)
    # the oracle: gguf-py now reads that tensor as the new type
    assert next(t for t in gguf.GGUFReader(str(bad)).tensors
                if t.name == tensor).tensor_type.name == to != was.name
    r = run(specexport, "build", "--target", bad, "--out", tmp_path / "b", "--quiet")
    assert_input_error(r, "--target", "retyped.gguf", f"tensor {tensor!r} is {to}",
                       "its bytes do not match its type", DOWNLOAD)
    assert "tie_word_embeddings" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
