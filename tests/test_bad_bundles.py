"""A bundle is untrusted input: every way it can disagree with itself, with its graphs or with the
file system ends at load time in one BundleError naming the field or file and the fix, and in
`specrun` as exit code 2 with one line on stderr, never a traceback, a hang or a wrong graph run.

Each case damages a copy of the tiny llama bundle the way a user or a bad copy would; where the
damage is to a file, the manifest's size and sha256 are "fixed" to match, so that only the checks
beyond the hashes can catch it."""

import builtins
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import spec_runtime
from spec_runtime.bundle.manifest import BundleError, sha256_file
from draftproof.cli.specrun import main as specrun
from helpers import edit_manifest, run


def rehash(bundle: Path, *names: str) -> None:
    def fix(m):
        for name in names:
            m["files"][name] = {"bytes": (bundle / name).stat().st_size,
                                "sha256": sha256_file(bundle / name)}
    edit_manifest(bundle, fix)


def graph(m, role="target", name="decoder"):
    return m[role]["graphs"][name]


def resize_cache(m, max_len):
    """max_len edited together with every cache shape the manifest describes: the manifest is
    consistent with itself, but not with the graph."""
    m["max_len"] = max_len
    for role in ("target", "draft"):
        for io in graph(m, role)["inputs"] + graph(m, role)["outputs"]:
            if io["name"].startswith(("past_", "present_")):
                io["shape"][2] = max_len + 1


def other_graph_over_target(b):
    """The draft's graph (one layer, not three) saved as target.onnx, with its producer changed
    so that it is not byte for byte the draft file."""
    import onnx

    model = onnx.load(str(b / "draft.onnx"))
    model.producer_version = "edited"
    onnx.save(model, str(b / "target.onnx"))
    rehash(b, "target.onnx")


def copy_draft_over_target(b):
    shutil.copy(b / "draft.onnx", b / "target.onnx")
    rehash(b, "target.onnx")


def swap_graphs(b):
    """target.onnx and draft.onnx exchanged, and the manifest made to describe each file as what
    it now holds (shapes, sizes, hashes): only the graphs' own metadata still tell."""
    t, d = (b / "target.onnx").read_bytes(), (b / "draft.onnx").read_bytes()
    (b / "target.onnx").write_bytes(d)
    (b / "draft.onnx").write_bytes(t)

    def swap(m):
        gt, gd = graph(m, "target"), graph(m, "draft")
        for key in ("inputs", "outputs"):
            gt[key], gd[key] = gd[key], gt[key]
    edit_manifest(b, swap)
    rehash(b, "target.onnx", "draft.onnx")


def same_file_twice(b):
    edit_manifest(b, lambda m: graph(m, "draft").update(graph(m, "target")))


def same_graph_copied(b):
    """draft.onnx replaced by a copy of target.onnx, described as the target is."""
    shutil.copy(b / "target.onnx", b / "draft.onnx")
    rehash(b, "draft.onnx")
    edit_manifest(b, lambda m: graph(m, "draft").update(inputs=graph(m)["inputs"],
                                                         outputs=graph(m)["outputs"]))


def weights_beside(b):
    """target.onnx's weights moved to an external-data file the manifest does not list; the
    graph file itself re-hashed."""
    import onnx

    model = onnx.load(str(b / "target.onnx"))
    onnx.save(model, str(b / "target.onnx"), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    rehash(b, "target.onnx")


def vocabulary(b, edit):
    """tokenizer.json's vocabulary edited by `edit` (a dict of token -> id), re-hashed: the
    special tokens keep their ids, so only the vocabulary's own check can tell."""
    path = b / "tokenizer.json"
    t = json.loads(path.read_text())
    t["model"]["vocab"] = edit(t["model"]["vocab"])
    path.write_text(json.dumps(t))
    rehash(b, "tokenizer.json")


def rotate(vocab):
    """the ids of the byte tokens shifted by one (the specials stay)."""
    tokens = [k for k, v in sorted(vocab.items(), key=lambda kv: kv[1]) if v >= 3]
    ids = [vocab[k] for k in tokens]
    return {**{k: v for k, v in vocab.items() if v < 3}, **dict(zip(tokens, ids[1:] + ids[:1]))}


def cut(vocab):
    return {k: v for k, v in vocab.items() if v < len(vocab) - 20}


def nested(depth):
    value = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def link_outside(b, name):
    outside = b.parent / f"outside-{name}"
    shutil.move(b / name, outside)
    os.symlink(outside, b / name)


def set_template(template):
    return lambda b: edit_manifest(b, lambda m: m["tokenizer"].update(chat_template=template))


def tok(**fields):
    return lambda b: edit_manifest(b, lambda m: m["tokenizer"].update(fields))


CASES = {
    # manifest vs graph
    "vocab-size-edited": (lambda b: edit_manifest(b, lambda m: m["target"].update(
        vocab_size=300)), ["target.graphs.decoder", "vocab_size 300", "logits"]),
    "max-len-and-cache-shapes-edited": (lambda b: edit_manifest(b, lambda m: resize_cache(m, 200)),
                                        ["target.onnx", "past_key.0", "[1, 2, 201, 16]"]),
    "other-graph-saved-as-target": (other_graph_over_target, [
        "target.onnx", "is not the graph the manifest describes as target.graphs.decoder"]),
    "draft-graph-copied-over-target": (copy_draft_over_target, ["same graph", "target.onnx"]),
    "graphs-swapped-and-described": (swap_graphs, ["target.onnx", "draft/decoder/fp32",
                                                   "target/decoder/fp32"]),
    "draft-names-the-target-file": (same_file_twice, ["draft.graphs.decoder.file",
                                                      "target.graphs.decoder.file"]),
    "target-copied-as-draft": (same_graph_copied, ["same graph", "draft.onnx"]),
    "logits-dtype-edited": (lambda b: edit_manifest(b, lambda m: graph(m)["outputs"][0].update(
        dtype="float16")), ["logits", "float16"]),
    "negative-cache-dim": (lambda b: edit_manifest(b, lambda m: graph(m)["inputs"][3].update(
        shape=[1, -2, 97, 16])), ["target.graphs.decoder.inputs[3].shape", "[1, -2, 97, 16]"]),
    "input-renamed": (lambda b: edit_manifest(b, lambda m: graph(m)["inputs"][1].update(
        name="pos")), ["target.graphs.decoder", "position"]),
    # the model's sampling defaults: a key SamplingParams does not read, a value it refuses
    "generation-unknown-key": (lambda b: edit_manifest(b, lambda m: m.update(
        generation={"beam_width": 4})), ["generation.beam_width", "the keys are"]),
    "generation-bad-value": (lambda b: edit_manifest(b, lambda m: m.update(
        generation={"top_p": 1.5})), ["generation.top_p", "1.5"]),
    "generation-a-list": (lambda b: edit_manifest(b, lambda m: m.update(generation=[1])),
                          ["manifest generation is [1]", "object"]),
    # optional fields of the wrong type
    "special-tokens-a-list": (tok(special_tokens=["<s>"]), ["tokenizer.special_tokens"]),
    "special-token-an-id": (tok(special_tokens={"eos_token": 2}), ["tokenizer.special_tokens"]),
    "chat-template-a-number": (tok(chat_template=5), ["tokenizer.chat_template"]),
    "eos-ids-empty": (tok(eos_token_ids=[]), ["tokenizer.eos_token_ids", "non-empty"]),
    "eos-id-a-string": (tok(eos_token_ids=["2"]), ["tokenizer.eos_token_ids", "'2'"]),
    "eos-id-outside-vocab": (tok(eos_token_ids=[259]), ["tokenizer.eos_token_ids", "259"]),
    "bos-id-a-string": (tok(bos_token_id="1"), ["tokenizer.bos_token_id", "'1'"]),
    "ngram-size-a-string": (lambda b: edit_manifest(b, lambda m: m.update(draft={
        "kind": "ngram", "max_ngram": "3"})), ["draft.max_ngram", "'3'"]),
    "ngram-sizes-reversed": (lambda b: edit_manifest(b, lambda m: m.update(draft={
        "kind": "ngram", "max_ngram": 2, "min_ngram": 3})), ["draft.max_ngram"]),
    "max-gamma-huge": (lambda b: edit_manifest(b, lambda m: m.update(max_gamma=10**12)),
                       ["max_gamma", "1000000000000"]),
    "max-len-a-bool": (lambda b: edit_manifest(b, lambda m: m.update(max_len=True)),
                       ["max_len", "True", "an integer"]),
    "file-size-a-string": (lambda b: edit_manifest(b, lambda m: m["files"]["target.onnx"].update(
        bytes="12")), ["files['target.onnx'].bytes"]),
    "sha256-not-hex": (lambda b: edit_manifest(b, lambda m: m["files"]["target.onnx"].update(
        sha256="z" * 64)), ["files['target.onnx'].sha256"]),
    # files a graph reads, a tokenizer's vocabulary
    "graph-weights-in-an-unlisted-file": (weights_beside, ["target.onnx", "'weights.bin'",
                                                           "does not list"]),
    "tokenizer-vocabulary-rotated": (lambda b: vocabulary(b, rotate), ["tokenizer.json",
                                                                       "other ids"]),
    "tokenizer-vocabulary-cut": (lambda b: vocabulary(b, cut), ["tokenizer.json"]),
    # manifest.json itself
    "manifest-deeply-nested": (lambda b: (b / "manifest.json").write_text("[" * 100000),
                               ["not valid JSON"]),
    "manifest-valid-but-nested-700-deep": (lambda b: edit_manifest(b, lambda m: m.update(
        created_by=nested(700))), ["nests its values more than 32 deep"]),
    "file-name-of-300-characters": (lambda b: edit_manifest(b, lambda m: m["files"].update(
        {"a" * 300: {"bytes": 1, "sha256": "0" * 64}})), ["more than 255 bytes"]),
    "manifest-huge": (lambda b: (b / "manifest.json").write_bytes(b" " * (17 << 20)),
                      ["larger than 16 MB"]),
    "manifest-not-utf8": (lambda b: (b / "manifest.json").write_bytes(b"\xff\xfe{}"),
                          ["not valid JSON"]),
    # paths
    "file-name-climbs-out": (lambda b: edit_manifest(b, lambda m: (
        m["files"].update({"../tokenizer.json": m["files"].pop("tokenizer.json")}),
        m["tokenizer"].update(file="../tokenizer.json"))), ["'../tokenizer.json'",
                                                           "not a plain file name"]),
    "file-name-absolute": (lambda b: edit_manifest(b, lambda m: m["files"].update(
        {"/etc/hostname": {"bytes": 1, "sha256": "0" * 64}})), ["'/etc/hostname'"]),
    "tokenizer-links-outside": (lambda b: link_outside(b, "tokenizer.json"),
                                ["'tokenizer.json'", "outside the bundle"]),
    "graph-links-outside": (lambda b: link_outside(b, "target.onnx"),
                            ["'target.onnx'", "outside the bundle"]),
    "unlisted-link-outside": (lambda b: os.symlink("/etc/hostname", b / "target.onnx.data"),
                              ["'target.onnx.data'", "outside the bundle"]),
    # chat templates
    "template-syntax": (set_template("{% for %}"), ["chat template does not compile", "line 1"]),
    "template-undefined": (set_template("{{ nothing.here }}"), ["chat template failed",
                                                                "undefined"]),
    "template-escape": (set_template("{{ ''.__class__.__mro__[1].__subclasses__() }}"),
                        ["chat template failed", "SecurityError"]),
    "template-huge-string": (set_template("{{ 'a' * 100000000 }}"), ["chat template failed",
                                                                     "100000000"]),
    "template-endless-loops": (set_template(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
        ["chat template failed", "loop iterations"]),
    "template-doubling": (set_template(
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}"), ["chat template failed", "characters"]),
    # single calls at C speed, bounded before they run (each would take a GB or more)
    "template-join-of-repeats": (set_template("{{ (['a' * 1000000] * 1000)|join }}"),
                                 ["chat template failed", "characters"]),
    "template-join-separator": (set_template("{{ ('a' * 2000)|list|join('b' * 1000) }}"),
                                ["chat template failed", "the filter 'join'"]),
    "template-literal-of-repeats": (set_template("{% set x = 'a' * 600000 %}{{ [x, x]|join }}"),
                                    ["chat template failed", "a literal"]),
    # a list that holds another twice, 60 times over: 2**60 items for str() or `==` to walk
    "template-nested-aliases": (set_template(
        "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}"
        "{% endfor %}{{ ns.l }}"), ["chat template failed", "a literal"]),
    "template-tojson-indent": (set_template("{{ (range(1000)|list)|tojson(indent=1000000) }}"),
                               ["chat template failed", "the filter 'tojson'"]),
    "template-indent-string": (set_template("{{ ('a\n' * 1000)|indent('b' * 1000000) }}"),
                               ["chat template failed", "the filter 'indent'"]),
    "template-format-fields": (set_template("{{ ('{0}' * 300000).format('a' * 1000000) }}"),
                               ["chat template failed", "{}-format would make more than"]),
    "template-percent-fields": (set_template("{{ ('%s' * 500000) % (('a' * 1000000,) * 500000) }}"),
                                ["chat template failed", "characters"]),
    "template-expandtabs": (set_template("{{ ('\t' * 1000000).expandtabs(1000000) }}"),
                            ["chat template failed", "expandtabs()"]),
    "template-translate": (set_template(
        "{{ ('a' * 1000000).translate(''.maketrans({'a': 'b' * 1000})) }}"),
        ["chat template failed", "translate()"]),
    "template-wordwrap": (set_template("{{ ('x' * 1000)|wordwrap(1, wrapstring='y' * 1000000) }}"),
                          ["chat template failed", "the filter 'wordwrap'"]),
    "template-refuses-everything": (set_template("{{ raise_exception('no') }}"),
                                    ["refuses a one-message conversation", "no"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_bundle_is_refused_at_load_and_by_the_cli(bundle_copy, case):
    damage, words = CASES[case]
    damage(bundle_copy)
    with pytest.raises(BundleError) as err:
        spec_runtime.load(bundle_copy)
    message = str(err.value)
    for w in words:
        assert w in message, message
    assert "\n" not in message and ("specexport build" in message or "copy" in message), message
    r = run(specrun, "generate", "hi", "--bundle", bundle_copy, "--max-new-tokens", 3)
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and words[0] in r.stderr, r.stderr


@pytest.mark.parametrize("case", ["file-name-climbs-out", "tokenizer-links-outside",
                                  "graph-links-outside", "unlisted-link-outside"])
def test_files_stay_inside_the_bundle_without_hash_checks(bundle_copy, case):
    damage, words = CASES[case]
    damage(bundle_copy)
    with pytest.raises(BundleError, match="outside the bundle|not a plain file name"):
        spec_runtime.load(bundle_copy, check_files=False)


@pytest.fixture
def unreadable(monkeypatch):
    """make(path): opening `path` fails with EACCES, as for a file of another user (a real
    chmod does not stop root, which the tests may run as)."""
    denied = set()
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) in denied:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    return lambda path: denied.add(os.path.abspath(path))


@pytest.mark.parametrize("name", ["manifest.json", "target.onnx", "tokenizer.json"])
@pytest.mark.parametrize("check_files", [True, False])
def test_unreadable_file_names_path_and_reason(bundle_copy, unreadable, name, check_files):
    unreadable(bundle_copy / name)
    with pytest.raises(BundleError, match="Permission denied") as err:
        spec_runtime.load(bundle_copy, check_files=check_files)
    assert name in str(err.value) and "\n" not in str(err.value)
    if check_files:
        r = run(specrun, "generate", "hi", "--bundle", bundle_copy)
        assert r.exit_code == 2 and "Permission denied" in r.stderr and name in r.stderr, r.output
        assert "Traceback" not in r.output


def test_a_template_that_breaks_on_some_messages_fails_then_with_a_bundle_error(bundle_copy):
    """Loads (one message renders), then the conversation that triggers the bomb is refused in
    bounded time; a template's own refusal is the user's input error, not the bundle's."""
    set_template("{% if messages|length > 1 %}{{ 'a' * 10**9 }}{% endif %}"
                 "{% for m in messages %}{% if m.role == 'system' %}"
                 "{{ raise_exception('no system role') }}{% endif %}{{ m.content }}"
                 "{% endfor %}")(bundle_copy)
    gen = spec_runtime.load(bundle_copy)
    assert gen.apply_chat_template("hi") == "hi"
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(BundleError, match="chat template failed"):
        gen.apply_chat_template(two)
    with pytest.raises(ValueError, match="no system role") as err:
        gen.apply_chat_template([{"role": "system", "content": "x"}])
    assert not isinstance(err.value, BundleError)


def test_loop_controls_and_tojson_render_as_in_hugging_face(bundle_copy):
    """Templates in the wild use {% break %} and tojson (loopcontrols, Hugging Face's filter)."""
    set_template("{% for m in messages %}{{ m|tojson }}{% break %}{% endfor %}")(bundle_copy)
    gen = spec_runtime.load(bundle_copy)
    messages = [{"role": "user", "content": "é"}, {"role": "user", "content": "b"}]
    assert gen.apply_chat_template(messages) == json.dumps(messages[0], ensure_ascii=False)


@pytest.mark.parametrize("name", ["tokenizer.json", "target.onnx", "manifest.json"])
@pytest.mark.parametrize("check_files", [True, False])
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(bundle_copy, name, check_files):
    """Opening a FIFO blocks until someone writes to it: the load names it, in a process of
    its own here so that a regression ends as a failure after 60 s instead of a hung suite."""
    (bundle_copy / name).unlink()
    os.mkfifo(bundle_copy / name)
    code = (f"import spec_runtime\ntry:\n    spec_runtime.load({str(bundle_copy)!r}, "
            f"check_files={check_files})\nexcept spec_runtime.BundleError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert name in r.stdout and "FIFO" in r.stdout and "missing" not in r.stdout, r.stdout


def test_a_file_swapped_between_the_check_and_the_load_is_refused(bundle_copy, monkeypatch):
    """Hashes vouch only for the bytes that were hashed: target.onnx replaced (same graph,
    other weights, a consistent size) after the check and before ONNX Runtime reads it."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(bundle_copy / "target.onnx"))
    init = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    init.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(init), init.name))
    altered = bundle_copy.parent / "altered.onnx"
    onnx.save(model, str(altered))

    from spec_runtime import loading as bundle

    load_tokenizer = bundle.load_tokenizer

    def swap_then_load(path):  # after the hashes, before the sessions
        os.replace(altered, bundle_copy / "target.onnx")
        return load_tokenizer(path)

    monkeypatch.setattr(bundle, "load_tokenizer", swap_then_load)
    with pytest.raises(BundleError, match="changed while it loaded.*target.onnx"):
        spec_runtime.load(bundle_copy)


# -- a trimmed draft head's kept ids (draft.vocab) ------------------------------------------------

@pytest.fixture(scope="module")
def trimmed_bundle(llama_pair, tmp_path_factory):
    from spec_export.build import build_bundle

    target, draft, _ = llama_pair
    return build_bundle(str(target), str(draft), tmp_path_factory.mktemp("trimmed") / "b",
                        max_len=32, draft_vocab=100, progress=False)


def kept_ids(edit):
    """Rewrite the kept ids with `edit` and fix their hash: only the id checks can catch it."""
    def damage(b):
        path = b / "draft-vocab.json"
        ids = json.loads(path.read_text())["kept_ids"]
        path.write_text(json.dumps({"kept_ids": edit(ids)}))
        rehash(b, "draft-vocab.json")
    return damage


def narrower(b):
    """One id fewer, and the manifest's size, vocab_size and logits width all edited to match:
    only ONNX Runtime's view of the graph disagrees."""
    kept_ids(lambda ids: ids[:-1])(b)

    def fix(m):
        m["draft"]["vocab"]["size"] = m["draft"]["vocab_size"] = 99
        logits = next(o for o in graph(m, "draft")["outputs"] if o["name"] == "logits")
        logits["shape"][-1] = 99
    edit_manifest(b, fix)


TRIMMED_CASES = {
    "unsorted": (kept_ids(lambda ids: [ids[1], ids[0], *ids[2:]]),
                 ["draft-vocab.json", "not strictly increasing"]),
    "repeated": (kept_ids(lambda ids: [ids[0], *ids[:-1]]), ["not strictly increasing"]),
    "negative": (kept_ids(lambda ids: [-1, *ids[1:]]), ["not strictly increasing"]),
    "out-of-range": (kept_ids(lambda ids: [*ids[:-1], 100000]),
                     ["holds id 100000, outside the target's vocabulary"]),
    "wrong-count": (kept_ids(lambda ids: ids[:-1]), ["lists 99 ids", "100 wide"]),
    "narrower-graph": (narrower, ["draft.onnx", "logits"]),
    "missing-eos": (kept_ids(lambda ids: sorted(set(ids) - {2} | {min(set(range(259)) - set(ids))})),
                    ["lacks the end-of-sequence id 2"]),
    "not-json": (lambda b: ((b / "draft-vocab.json").write_text("[1, 2"),
                            rehash(b, "draft-vocab.json")), ["is not JSON"]),
    "no-list": (lambda b: ((b / "draft-vocab.json").write_text('{"kept_ids": "0-99"}'),
                           rehash(b, "draft-vocab.json")), ["no kept_ids list"]),
    "schema-3": (lambda b: edit_manifest(b, lambda m: m.update(schema_version=3)),
                 ["draft.vocab", "schema_version 3 predates it"]),
    "size-not-the-width": (lambda b: edit_manifest(
        b, lambda m: m["draft"]["vocab"].update(size=50)), ["draft.vocab.size is 50"]),
    "file-unlisted": (lambda b: edit_manifest(
        b, lambda m: m["draft"]["vocab"].update(file="other.json")), ["'other.json'"]),
}


@pytest.mark.parametrize("case", list(TRIMMED_CASES))
def test_damaged_kept_ids_are_refused_at_load_and_by_the_cli(trimmed_bundle, tmp_path, case):
    bundle = tmp_path / "b"
    shutil.copytree(trimmed_bundle, bundle)
    spec_runtime.load(bundle)  # whole, it loads
    damage, words = TRIMMED_CASES[case]
    damage(bundle)
    with pytest.raises(BundleError) as err:
        spec_runtime.load(bundle)
    message = str(err.value)
    assert all(w in message for w in words) and "\n" not in message, message
    r = run(specrun, "generate", "hi", "--bundle", bundle, "--max-new-tokens", 3)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and words[0] in r.stderr, r.stderr
