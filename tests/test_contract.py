"""The one description of the exporter/runtime contract: graph I/O written out by hand for both
cache layouts, the manifest's one writer and one reader (round trip, nothing mutated), the
draft registry (a new kind is one class and one entry), and engines that own their cache (two
forks of one session decode side by side as if alone)."""

import copy
import json

import numpy as np
import pytest

import spec_runtime
from spec_runtime.decode import drafts
from spec_runtime.bundle.contract import Dims, decoder_io, encoder_io, mismatch
from spec_runtime.bundle.manifest import Manifest, read_manifest, write_manifest
from spec_runtime.errors import BundleError
from helpers import edit_manifest


def io(name, dtype, shape):
    return {"name": name, "dtype": dtype, "shape": shape}


def test_decoder_io_is_the_documented_contract():
    """Two layers, two KV heads of 16, vocabulary 259, max_len 96, written out by hand."""
    dims = Dims(n_layers=2, kv_heads=2, head_dim=16, vocab_size=259)
    past = lambda s: [io(f"past_{k}.{i}", "float32", s) for i in range(2) for k in ("key", "value")]
    present = lambda s: [io(f"present_{k}.{i}", "float32", s) for i in range(2)
                         for k in ("key", "value")]
    ids = [io("input_ids", "int64", [1, "n"]), io("position", "int64", []),
           io("num_logits", "int64", [])]
    logits = io("logits", "float32", [1, "num_logits", 259])
    assert decoder_io(dims, 96, "new-slots") == (ids + past([1, 2, 96, 16]),
                                                 [logits] + present([1, 2, "n", 16]))
    assert decoder_io(dims, 96, "in-place") == (ids + past([1, 2, 97, 16]),
                                                [logits] + present([1, 2, 97, 16]))
    ins, outs = decoder_io(dims, 96, "new-slots", max_source_len=7, hidden_size=64)
    assert [i["name"] for i in ins[-5:]] == ["cross_key.0", "cross_value.0", "cross_key.1",
                                              "cross_value.1", "source_mask"]
    assert ins[-1]["shape"] == [1, 7] and ins[-2]["shape"] == [1, 2, 7, 16]
    assert outs[1] == io("hidden", "float32", [1, "num_logits", 64])
    enc_ins, enc_outs = encoder_io(dims, 7)
    assert enc_outs == ins[-5:-1] and [i["shape"] for i in enc_ins] == [[1, 7], [1, 7]]


def test_mismatch_names_the_first_difference():
    dims = Dims(1, 2, 16, 10)
    want = decoder_io(dims, 32, "new-slots")
    assert mismatch(want, want) is None
    wider = decoder_io(Dims(1, 2, 16, 11), 32, "new-slots")
    assert mismatch(wider, want) == ("output logits is float32 [1, num_logits, 11], expected "
                                     "float32 [1, num_logits, 10]")
    fewer = (want[0][:-1], want[1])
    assert mismatch(fewer, want) == "its inputs differ: past_value.0 missing, none unexpected"
    renamed = (want[0], [dict(want[1][0], shape=[1, None, 10])] + want[1][1:])
    assert mismatch(renamed, want, exact_dims=False) is None  # any symbolic dim is symbolic
    assert mismatch(renamed, want) is not None


def test_manifest_round_trips_through_its_one_writer_and_reader(llama_pair, tmp_path):
    on_disk = json.loads((llama_pair[2] / "manifest.json").read_text())
    m = read_manifest(llama_pair[2])
    assert m.to_json() == on_disk  # every field the writer wrote is read back, nothing added
    assert m.draft.model is not None and m.target.graphs["decoder"].kv_cache == "in-place"
    # the writer lists the directory's files, and writes only what the reader accepts
    import shutil

    copy_dir = tmp_path / "b"
    shutil.copytree(llama_pair[2], copy_dir)
    (copy_dir / "a.bin").write_bytes(b"x" * 10)
    written = write_manifest(copy_dir, m)
    assert set(written.files) == set(m.files) | {"a.bin"} and written.files["a.bin"].bytes == 10
    assert read_manifest(copy_dir) == written
    before = (copy_dir / "manifest.json").read_bytes()
    for broken in (Manifest(**{**m.__dict__, "max_gamma": m.max_len + 5}),
                   Manifest(**{**m.__dict__, "files": {}})):
        with pytest.raises(BundleError):
            write_manifest(copy_dir if broken.files else tmp_path, broken)
    assert (copy_dir / "manifest.json").read_bytes() == before


def test_the_reader_never_changes_what_it_read(llama_portable_pair):
    """A schema-1 manifest (no kernels, no kv_cache) is read with its implied values, and the
    dict it came from is left as it was."""
    d = json.loads((llama_portable_pair[2] / "manifest.json").read_text())
    d["schema_version"] = 1
    for role in ("target", "draft"):
        for key in ("kernels", "kv_cache"):
            d[role]["graphs"]["decoder"].pop(key)
    before = copy.deepcopy(d)
    m = Manifest.from_json(d)
    assert d == before
    assert (m.target.graphs["decoder"].kernels, m.target.graphs["decoder"].kv_cache) == \
        ("portable", "new-slots")


class EchoDraft:
    """A draft kind written for this test: proposes the last token again, γ times."""

    kind = "echo"
    engines = ()  # no model, no cache

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.counters = drafts.DraftCounters()

    @classmethod
    def from_bundle(cls, entry, target_vocab, open_engine):
        return cls(target_vocab)

    def reset(self):
        self.counters = drafts.DraftCounters()

    def propose(self, seq, gamma, params, rng, most=None, floor=None):
        self.counters.calls += 1
        tokens = np.full(gamma, seq[-1], np.int64)
        p = None if params.greedy else np.eye(self.vocab_size)[tokens]
        return tokens, p

    def rewind(self, n_valid):
        pass


def test_a_new_draft_kind_is_one_class_and_one_registry_entry(bundle_copy, monkeypatch):
    """Registered under a name, named by the manifest, driven by the loop through the interface
    alone; output equals target-only."""
    monkeypatch.setitem(drafts.DRAFTS, "echo", EchoDraft.from_bundle)
    edit_manifest(bundle_copy, lambda m: (m.update(draft={"kind": "echo"}),
                                          m["files"].pop("draft.onnx")))
    (bundle_copy / "draft.onnx").unlink()
    gen = spec_runtime.load(bundle_copy)
    assert isinstance(gen.draft, EchoDraft)
    r = gen.generate("aaaa", max_new_tokens=12, gamma=3)
    assert r.tokens == gen.generate("aaaa", max_new_tokens=12, use_draft=False).tokens
    assert r.stats.draft_kind == "echo"
    assert r.stats.draft_calls == sum(g > 0 for g in r.stats.gammas_used)  # a 0 is no call
    monkeypatch.delitem(drafts.DRAFTS, "echo")
    with pytest.raises(BundleError, match="'echo' is not one this runtime knows"):
        spec_runtime.load(bundle_copy)


@pytest.mark.parametrize("pair", ["llama_pair", "llama_portable_pair"])
def test_forked_engines_share_the_session_and_keep_their_own_cache(pair, request):
    """Two requests interleaved call by call on two forks of one engine give the logits each
    gives alone: the cache is per fork, the weights are not loaded twice."""
    gen = spec_runtime.load(request.getfixturevalue(pair)[2])
    a, b = gen.target, gen.target.fork()
    assert b.session is a.session and b.cache is not a.cache
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 259, 30), rng.integers(3, 259, 30)]
    calls = [(0, 12, 3), (12, 1, 1), (13, 5, 5), (15, 4, 2)]  # prefill, step, verify, rollback

    def run(engine, seq, pos, n, rows):
        return engine.forward(seq[pos : pos + n], pos, rows).copy()

    alone = [[run(a, s, *c) for c in calls] for s in seqs]
    together = [[], []]
    for c in calls:
        for i, engine in enumerate((a, b)):
            together[i].append(run(engine, seqs[i], *c))
    for x, y in zip(alone, together):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


def test_an_engine_refuses_positions_past_its_cache(llama_pair):
    """Caught inside forward, as the input error it is, before ONNX Runtime sees the call."""
    from spec_runtime.errors import CacheCapacityError

    engine = spec_runtime.load(llama_pair[2]).target
    engine.forward(np.array([5]), engine.max_len - 1)  # the last slot: fine
    with pytest.raises(CacheCapacityError, match=r"positions 95\.\.96 exceed the cache"):
        engine.forward(np.array([5, 6]), engine.max_len - 1)
