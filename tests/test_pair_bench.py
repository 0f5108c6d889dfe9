"""The pair race's bookkeeping (benchmarks/pair.py, pair_report.py, model_files.py) on runs
written by hand: every expected figure below is computed by hand from those runs; and
draft_agreement.py's counts, against transformers."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import model_files  # noqa: E402
import pair  # noqa: E402
import pair_report  # noqa: E402


def run(prompt, kind, system, tokens, wall, repeat=0, **info):
    return {"prompt": prompt, "kind": kind, "repeat": repeat, "system": system,
            "new_tokens": len(tokens), "wall_s": wall, "tokens_per_s": len(tokens) / wall,
            "info": info, "tokens": tokens}


SYSTEMS = {
    "hf": {"family": "hf", "plain": None, "what": "PyTorch eager", "weight_bytes": 8 * 10**9},
    "ortgenai": {"family": "ortgenai", "plain": None, "what": "-p fp32",
                 "weight_bytes": 4 * 10**9},
    "ortgenai-draft": {"family": "ortgenai", "plain": "ortgenai", "what": "draft",
                       "weight_bytes": 4 * 10**9},
    "ours-target": {"family": "ours", "plain": None, "what": "bundle B, use_draft=False",
                    "weight_bytes": 2 * 10**9},
    "ours": {"family": "ours", "plain": "ours-target", "what": "bundle B",
             "weight_bytes": 2 * 10**9},
}
RUNS = [
    run(0, "code", "hf", [1, 2, 3, 4], 2.0, target_calls=4),
    run(0, "code", "ortgenai", [1, 2, 3, 4], 1.0, target_calls=4),
    run(0, "code", "ortgenai-draft", [1, 2, 3, 4], 0.5, target_calls=2, accepted=2, proposed=4),
    run(0, "code", "ours-target", [1, 2, 3, 4], 0.5, target_calls=4),
    run(0, "code", "ours", [1, 2, 3, 4], 0.25, target_calls=1, accepted=3, proposed=3),
    run(1, "chat", "hf", [5, 6], 1.0, target_calls=2),
    run(1, "chat", "ortgenai", [5, 6], 0.5, target_calls=2),
    run(1, "chat", "ortgenai-draft", [5, 7], 0.25, target_calls=1, accepted=1, proposed=2),
    run(1, "chat", "ours-target", [5, 6], 0.5, target_calls=2),
    run(1, "chat", "ours", [5, 6, 9], 0.5, target_calls=2, accepted=1, proposed=4),
]


def test_summary_counts_tokens_per_call_acceptance_and_hf_ratio():
    s = pair_report.summarise(RUNS, SYSTEMS, None)
    assert list(s) == ["code", "chat", "all"]
    code = s["code"]
    assert code["ortgenai-draft"]["tokens_per_s"]["median"] == pytest.approx(8.0)
    assert code["ortgenai-draft"]["vs_hf"] == pytest.approx(8.0 / 2.0)
    assert code["ortgenai-draft"]["tokens_per_call"] == pytest.approx(4 / 2)
    assert code["ortgenai-draft"]["acceptance"] == pytest.approx(2 / 4)
    assert "acceptance" not in code["ortgenai"]
    every = s["all"]["ours"]
    assert every["tokens_per_call"] == pytest.approx((4 + 3) / (1 + 2))
    assert every["acceptance"] == pytest.approx((3 + 1) / (3 + 4))
    assert every["tokens_per_s"]["median"] == pytest.approx((16 + 6) / 2)


def test_summary_takes_hf_from_the_float_reference_when_hf_did_not_run():
    runs = [r for r in RUNS if r["system"] != "hf"]
    s = pair_report.summarise(runs, {k: v for k, v in SYSTEMS.items() if k != "hf"},
                              {"code": 2.0, "chat": 4.0})
    assert s["chat"]["ortgenai"]["vs_hf"] == pytest.approx(4.0 / 4.0)
    assert "vs_hf" not in s["all"]["ortgenai"]


def test_own_greedy_compares_each_speculative_row_with_its_own_target_only_row():
    og = pair_report.own_greedy(RUNS, SYSTEMS)
    assert og["ortgenai-draft"] == {"equal": 1, "prompts": 2, "first_diff": {1: 1}}
    # a longer output with an equal start differs where the shorter one ends
    assert og["ours"] == {"equal": 1, "prompts": 2, "first_diff": {1: 2}}
    assert "hf" not in og and "ours-target" not in og


def test_targets_are_our_best_over_the_best_peer_per_kind():
    s = pair_report.summarise(RUNS, SYSTEMS, None)
    t = {(x["kind"], x["ours"]): x for x in
         pair_report.targets(s, SYSTEMS, "fp32", default="ours-target")}
    # code: ours 16 tok/s, best peer ortgenai-draft 8 tok/s, wanted 1.0
    assert t[("code", "ours")]["peer"] == "ortgenai-draft"
    assert t[("code", "ours")]["ratio"] == pytest.approx(2.0) and t[("code", "ours")]["met"]
    # chat: ours 6, ours-target 4; best peer ortgenai-draft 8: 0.75 < 1.0
    assert t[("chat", "ours")]["ratio"] == pytest.approx(6 / 8)
    assert not t[("chat", "ours")]["met"]
    # the default row against our best: code 8 / 16
    assert t[("code", "ours-target")]["ratio"] == pytest.approx(0.5)
    assert not t[("code", "ours-target")]["met"]


def test_bandwidth_rows_only_for_target_only_rows():
    s = pair_report.summarise(RUNS, SYSTEMS, None)
    rows = pair_report.bandwidth_rows(s, SYSTEMS, gbps=20.0)
    assert set(rows) == {"hf", "ortgenai", "ours-target"}
    # ortgenai: ceiling 20e9 / 4e9 = 5 tok/s; its median over both prompts (4 + 4) / 2 = 4
    assert rows["ortgenai"]["ceiling_tokens_per_s"] == pytest.approx(5.0)
    assert rows["ortgenai"]["fraction"] == pytest.approx(4 / 5)


@pytest.mark.parametrize("hidden, mlp, group", [(1536, 8960, 128), (896, 4864, 128),
                                                (576, 1536, 64), (2048, 5632, 128)])
def test_openvino_int4_group_size_divides_every_width(hidden, mlp, group):
    assert model_files.ov_group_size({"hidden_size": hidden, "intermediate_size": mlp}) == group


def test_openvino_int4_group_size_refuses_widths_no_group_divides():
    with pytest.raises(ValueError, match="100"):
        model_files.ov_group_size({"hidden_size": 100, "intermediate_size": 256})


def test_results_are_not_overwritten_without_replace(tmp_path, capsys):
    (tmp_path / "pair-fp32.json").write_text("{}")
    with pytest.raises(SystemExit):
        pair.parse_args(["--out", str(tmp_path)])
    assert "--replace" in capsys.readouterr().err
    assert pair.parse_args(["--out", str(tmp_path), "--replace"]).replace


def test_a_draftproof_row_needs_a_bundle_directory(tmp_path, capsys):
    with pytest.raises(SystemExit):
        pair.parse_args(["--out", str(tmp_path), "--draftproof", f"x={tmp_path}"])
    assert "manifest.json" in capsys.readouterr().err


def test_hf_assisted_draft_length_option_sets_the_tokens_per_target_call():
    """The assistant is the target itself and drafts without its confidence cut-off, so every
    draft token is accepted and a target call makes exactly k + 1 tokens: 12 tokens take
    ceil(12 / (k + 1)) calls. Without k, transformers' own default drafts all 11 at once, also
    after runs with k."""
    import peers
    from tiny_models import llama

    target = llama(0, layers=2).eval()
    assistant = llama(0, layers=2).eval()
    assistant.generation_config.assistant_confidence_threshold = 0.0
    hf = peers.HFGenerate(target, 0, False, [2], assistant)
    ids = [5, 6, 7, 8, 9, 10]
    default = hf.run(ids, 12)
    assert default.info == {"target_calls": 1, "accepted": 11, "proposed": 11}
    for k in (1, 2, 4):
        r = hf.run(ids, 12, k=k)
        assert r.tokens == default.tokens
        assert r.info["target_calls"] == -(-12 // (k + 1))
        assert r.info["accepted"] == r.info["proposed"] == 12 - r.info["target_calls"]
    assert hf.run(ids, 12).info == default.info


def test_prompts_interleave_kinds_and_keep_the_first_of_each():
    prompts = [{"kind": k, "text": f"{k}{i}"} for k, n in (("code", 3), ("chat", 1),
                                                              ("grounded", 2)) for i in range(n)]
    assert [p["text"] for p in pair.interleave(prompts)] == \
        ["code0", "chat0", "grounded0", "code1", "grounded1", "code2"]
    assert [p["text"] for p in pair.interleave(prompts, limit=1)] == \
        ["code0", "chat0", "grounded0"]


class FakeWorker:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def run(self, ids, n, options):
        self.log.append((self.name, ids[0]))
        return {"tokens": [1] * n, "wall_s": 1.0, "info": {}, "peak_rss": 1}


class FakePool:
    def __init__(self):
        self.log, self.starts = [], []

    def start(self, s):
        self.starts.append(s.name)
        return FakeWorker(s.name, self.log)

    def note_rss(self, name, answer):
        pass

    def end_turn(self, name):
        pass

    def stop(self, name):
        pass


def test_race_turns_rotate_by_block_and_run_every_prompt_and_repeat():
    """3 systems, 4 prompts, 2 a turn, 2 repeats: two passes of 2 turns each, the order
    rotating by one system every turn across passes; every system runs each prompt twice,
    once a pass."""
    systems = [pair.System(n, [["x"]], ["-"], "hf") for n in ("a", "b", "c")]
    prompts = [{"kind": "code", "ids": [i]} for i in range(4)]
    args = type("A", (), {"turn_prompts": 2, "repeats": 2, "max_new_tokens": 3})()
    pool = FakePool()
    runs, loads = pair.race(systems, prompts, args, pool, failed={})
    assert pool.starts == list("abc" "bca" "cab" "abc")
    assert pool.log[:3] == [("a", 0), ("a", 1), ("b", 0)]
    assert sorted((r["system"], r["prompt"], r["repeat"]) for r in runs) == \
        sorted((n, i, k) for n in "abc" for i in range(4) for k in range(2))
    assert [x["after_prompt"] for x in loads] == [1, 3, 1, 3]


def test_race_puts_every_system_in_every_slot_given_as_many_turns():
    """5 systems, 3 prompts a pass, 2 passes: 6 turns ≥ 5 systems, so each system runs first,
    last and everywhere between at least once (the order no longer favours the last rows)."""
    systems = [pair.System(n, [["x"]], ["-"], "hf") for n in "abcde"]
    prompts = [{"kind": "code", "ids": [i]} for i in range(3)]
    args = type("A", (), {"turn_prompts": 1, "repeats": 2, "max_new_tokens": 1})()
    runs, _ = pair.race(systems, prompts, args, FakePool(), failed={})
    slots = {n: {r["slot"] for r in runs if r["system"] == n} for n in "abcde"}
    assert all(s == set(range(5)) for s in slots.values()), slots


def test_fewer_turns_than_systems_spread_each_systems_slots_first_to_last():
    """8 systems, 2 turns a pass, 2 passes: 4 turns, a stride of 2 systems a turn, so each
    system runs in 4 slots 2 apart, one of them in the first half and one in the second."""
    systems = [pair.System(n, [["x"]], ["-"], "hf") for n in "abcdefgh"]
    prompts = [{"kind": "code", "ids": [i]} for i in range(2)]
    args = type("A", (), {"turn_prompts": 1, "repeats": 2, "max_new_tokens": 1})()
    runs, _ = pair.race(systems, prompts, args, FakePool(), failed={})
    for n in "abcdefgh":
        slots = sorted({r["slot"] for r in runs if r["system"] == n})
        assert len(slots) == 4 and min(slots) < 4 <= max(slots), (n, slots)


def _onnx_with_embedding(path, tied: bool):
    """An embedding table [100, 8] float32 (3200 B) gathered through a Reshape, an output
    matrix [8, 100] (3200 B; the table's transpose when tied) and a [8, 8] layer (256 B)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    emb = numpy_helper.from_array(np.zeros((100, 8), np.float32), "emb")
    shape = numpy_helper.from_array(np.array([100, 8], np.int64), "shape")  # 16 B
    layer = numpy_helper.from_array(np.zeros((8, 8), np.float32), "layer")
    nodes = [helper.make_node("Reshape", ["emb", "shape"], ["emb2"]),
             helper.make_node("Gather", ["emb2", "ids"], ["x"]),
             helper.make_node("MatMul", ["x", "layer"], ["h"])]
    inits = [emb, shape, layer]
    if tied:
        nodes += [helper.make_node("Transpose", ["emb"], ["head"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "head"], ["y"])]
    else:
        inits.append(numpy_helper.from_array(np.zeros((8, 100), np.float32), "head"))
        nodes.append(helper.make_node("MatMul", ["h", "head"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                         [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 100])],
                              inits)
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_step_bytes_leave_out_only_a_table_a_step_gathers_from(tmp_path):
    untied = _onnx_with_embedding(tmp_path / "untied.onnx", tied=False)
    tied = _onnx_with_embedding(tmp_path / "tied.onnx", tied=True)
    assert model_files.step_bytes(untied) == 16 + 256 + 3200  # shape, layer, head
    assert model_files.step_bytes(tied) == 3200 + 16 + 256  # the table is the head too


def test_step_bytes_of_a_safetensors_checkpoint(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {"model.embed_tokens.weight": np.zeros((100, 8), np.float32),
               "model.layers.0.w.weight": np.zeros((8, 8), np.float32)}
    save_file(tensors, tmp_path / "tied.safetensors")
    save_file({**tensors, "lm_head.weight": np.zeros((100, 8), np.float32)},
              tmp_path / "untied.safetensors")
    assert model_files.step_bytes(tmp_path / "tied.safetensors") == 3200 + 256
    assert model_files.step_bytes(tmp_path / "untied.safetensors") == 256 + 3200


def test_step_bytes_of_a_gguf_file(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    for name, tensors in (("tied", ("token_embd.weight", "blk.0.w.weight")),
                          ("untied", ("token_embd.weight", "blk.0.w.weight", "output.weight"))):
        w = GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        for t in tensors:
            w.add_tensor(t, np.zeros((64, 8) if t != "blk.0.w.weight" else (8, 8), np.float32))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert model_files.step_bytes(tmp_path / "tied.gguf") == 2048 + 256
    assert model_files.step_bytes(tmp_path / "untied.gguf") == 256 + 2048


def test_step_bytes_of_an_openvino_ir(tmp_path):
    """A compressed table decompressed (Convert, Multiply) into a Gather's data port is left
    out; a constant that also reaches a MatMul, or feeds a Gather's indices port, is not."""
    layers = [("0", "Const", 3200), ("1", "Convert", 0), ("2", "Const", 4), ("3", "Multiply", 0),
              ("4", "Parameter", 0), ("5", "Gather", 0), ("6", "Const", 256), ("7", "MatMul", 0),
              ("8", "Const", 8)]
    edges = [("0", "1", "0"), ("1", "3", "0"), ("2", "3", "1"), ("3", "5", "0"),
             ("4", "5", "1"), ("5", "7", "0"), ("6", "7", "1"), ("8", "5", "2")]
    xml = "<net><layers>" + "".join(
        f'<layer id="{i}" type="{t}">' + (f'<data size="{n}"/>' if t == "Const" else "")
        + "</layer>" for i, t, n in layers) + "</layers><edges>" + "".join(
        f'<edge from-layer="{a}" from-port="9" to-layer="{b}" to-port="{p}"/>'
        for a, b, p in edges) + "</edges></net>"
    (tmp_path / "m.xml").write_text(xml)
    assert model_files.step_bytes(tmp_path / "m.bin") == 256 + 8


def test_draft_agreement_counts_what_hugging_face_predicts(llama_pair, tmp_path, capsys):
    """benchmarks/draft_agreement.py on the tiny pair's draft graph against the target's greedy
    outputs, checked with the draft model's own logits in transformers (teacher-forced)."""
    import json
    import re

    import torch
    from transformers import AutoModelForCausalLM

    import draft_agreement

    t_dir, d_dir, bundle = llama_pair
    target = AutoModelForCausalLM.from_pretrained(t_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(d_dir).eval()
    prompts = [("code", [5, 17, 99, 3, 42]), ("chat", [8, 8, 120, 7])]
    runs, want, close = [], {}, {}
    for i, (kind, ids) in enumerate(prompts):
        with torch.no_grad():
            out = target.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            logits = draft(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]
        want[kind] = int((logits.argmax(-1) == torch.tensor(out)).sum())
        # positions whose top two logits are too close for another CPU's kernels to order alike
        top2 = logits.topk(2, -1).values
        close[kind] = int((top2[:, 0] - top2[:, 1] < 1e-3).sum())
        runs.append({"system": "target-only", "prompt": i, "repeat": 0, "tokens": out})
    race = tmp_path / "race.json"
    race.write_text(json.dumps({"prompts": [{"kind": k, "ids": ids} for k, ids in prompts],
                                "runs": runs}))
    assert 0 < sum(want.values()) < 40  # neither none nor all: the count means something
    draft_agreement.main(["--race", str(race), str(bundle / "draft.onnx"), "--report",
                          str(tmp_path / "report")])
    line = capsys.readouterr().out
    assert "of 40 (" in line
    [md] = (tmp_path / "report").glob("draft-agreement-*.md")  # the dated report, as asked
    share = re.search(r"= target's token ([0-9.]+) of 40", line).group(1)
    assert f"| {bundle / 'draft.onnx'} | {share} |" in md.read_text()
    assert md.with_suffix(".png").stat().st_size > 0
    for kind in want:
        got = round(float(re.search(rf"{kind} ([0-9.]+)", line).group(1)) * 20)
        assert abs(got - want[kind]) <= close[kind], (kind, got, want[kind], close[kind])


def test_tree_gain_rounds_by_hand():
    """benchmarks/tree_gain.py's tokens per round, counted by hand on one rank sequence: ranks
    1 1 2 1 3 (the target's token is the draft's 1st, 1st, 2nd, 1st, 3rd choice)."""
    import numpy as np

    import tree_gain

    rank = np.array([1, 1, 2, 1, 3])
    # chain γ 2, start by start: t0 takes 1,1 and the target's (3); t1 takes 1, stops at the 2
    # (2); t2 stops at once (1); t3 takes 1, stops (2); t4 stops (1)
    assert tree_gain.tokens_per_round(rank, 2) == (3 + 2 + 1 + 2 + 1) / 5
    # top-2 leaves at depth 0: the 2 at t2 is taken (2 instead of 1); the 3 at t4 is not
    assert tree_gain.tokens_per_round(rank, 2, depth=1, k=2) == (3 + 2 + 2 + 2 + 1) / 5
    # leaves at depths 0 and 1: t1's miss at depth 1 is now a leaf (3); top-3 leaves also take
    # t3's 3 at depth 1 (3) and t4's 3 at depth 0 (2)
    assert tree_gain.tokens_per_round(rank, 2, depth=2, k=2) == (3 + 3 + 2 + 2 + 1) / 5
    assert tree_gain.tokens_per_round(rank, 2, depth=2, k=3) == (3 + 3 + 2 + 3 + 2) / 5
    # a chain longer than what is left of the output stops at its end: γ 8 from t0 takes 1,1
    assert tree_gain.tokens_per_round(rank, 8) == (3 + 2 + 1 + 2 + 1) / 5
    rows = {(g, d, k): n for g, d, k, n in tree_gain.shapes(5, max_gamma=3)}
    assert rows[(3, 0, 1)] == 4 and rows[(2, 2, 2)] == 5 and rows[(1, 1, 3)] == 4
    assert (3, 1, 2) in rows and (3, 2, 2) not in rows  # 6 rows: over the budget
    assert tree_gain.price({1: 0.1, 5: 0.2}, 3) == pytest.approx(0.15)


def test_tree_gain_ranks_are_the_draft_models_ranks_in_hugging_face(llama_pair, tmp_path,
                                                                      capsys):
    """tree_gain's rank of each target token among the draft graph's logits, against the draft
    model's own logits in transformers (teacher-forced); then the whole report on the tiny pair."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    import draft_agreement
    import tree_gain

    t_dir, d_dir, bundle = llama_pair
    target = AutoModelForCausalLM.from_pretrained(t_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(d_dir).eval()
    ids = [5, 17, 99, 3, 42]
    with torch.no_grad():
        out = target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        logits = draft(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]
    own = logits[torch.arange(len(out)), torch.tensor(out)]
    want = 1 + (logits > own[:, None]).sum(-1)
    # logits within 1e-3 of the target token's may order either way on another CPU's kernels
    slack = ((logits - own[:, None]).abs() < 1e-3).sum(-1) - 1
    got = tree_gain.ranks(draft_agreement.session(bundle / "draft.onnx", 2),
                          [("code", ids, out)])[0]
    assert (want > 1).any() and (want == 1).any()  # some misses, some hits: ranks matter here
    assert all(abs(int(g) - int(w)) <= int(s) for g, w, s in zip(got, want, slack)), (got, want)
    race = tmp_path / "race.json"
    race.write_text(json.dumps({"prompts": [{"kind": "code", "ids": ids}], "runs": [
        {"system": "target-only", "prompt": 0, "repeat": 0, "tokens": out}]}))
    tree_gain.main(["--race", str(race), "--draft", str(bundle / "draft.onnx"),
                    "--rows", "1,5", str(bundle / "target.onnx"), "--report", str(tmp_path)])
    report = capsys.readouterr().out
    assert "16 positions" in report and "best chain: γ" in report and "tree / chain:" in report
    [md] = tmp_path.glob("tree-gain-*.md")  # the dated report, as asked
    ratio = report.split("tree / chain: ")[1].split()[0]
    assert f"| {ratio} |" in md.read_text() and "16 positions" in md.read_text()
    assert md.with_suffix(".png").stat().st_size > 0


class SpeedWorker(FakeWorker):
    """Answers as fast as its variant and option say: tok/s = variant speed × k (threshold 1)."""

    def __init__(self, name, log, speed):
        super().__init__(name, log)
        self.speed = speed

    def run(self, ids, n, options):
        self.log.append((self.name, tuple(options.items())))
        return {"tokens": [1] * n, "wall_s": n / (self.speed * options.get("k", 1)),
                "info": {}, "peak_rss": 1}


def test_sweep_takes_the_fastest_variant_and_option_and_keeps_only_them():
    s = pair.System("x-draft", [["v0"], ["v1"]], ["slow", "fast"], "hf",
                    sweep=({}, {"k": 2}, {"k": 4}, {"threshold": 0.4}))
    pool = FakePool()
    pool.peak = {}
    pool.start = lambda s, i=0: SpeedWorker(s.name, pool.log, (1.0, 3.0)[i])
    prompts = [{"kind": k, "ids": [i]} for i, k in enumerate(("code", "chat", "grounded"))]
    args = type("A", (), {"sweep_prompts": 2, "max_new_tokens": 4})()
    rows = pair.sweep([s], prompts, args, pool)
    assert len(rows) == 2 * 4 and len(pool.log) == 2 * 4 * 2  # variants × options × prompts
    assert (s.cmds, s.labels, s.options) == ([["v1"]], ["fast"], {"k": 4})
    assert [r["chosen"] for r in rows] == [False] * 6 + [True, False]


def test_int4_target_only_is_compared_with_llamacpps_plain_decoding():
    """ours-target: 4 tokens in 0.5 s (8 tok/s) and 2 in 0.5 s (4); llamacpp: 4 in 0.4 s (10)
    and 2 in 0.25 s (8): medians 6 and 9, 0.67 of llama.cpp's, short of 0.9."""
    systems = {**SYSTEMS, "llamacpp": {"family": "llamacpp", "plain": None, "what": "server",
                                       "weight_bytes": 10**9}}
    runs = RUNS + [run(0, "code", "llamacpp", [1, 2, 3, 4], 0.4, target_calls=4),
                   run(1, "chat", "llamacpp", [5, 6], 0.25, target_calls=2)]
    s = pair_report.summarise(runs, systems, None)
    (t,) = [x for x in pair_report.targets(s, systems, "int4", None)
            if x["kind"] == "all, target-only"]
    assert (t["ours"], t["peer"]) == ("ours-target", "llamacpp")
    assert t["ratio"] == pytest.approx(6 / 9) and not t["met"]
    assert not [x for x in pair_report.targets(s, systems, "fp32", None)
                if x["kind"] == "all, target-only"]


def test_each_speculative_row_is_checked_against_its_own_bundles_target_only_row(llama_pair,
                                                                                  tmp_path):
    """Two bundles raced side by side: a speculative row's "= own greedy" names the target-only
    row of the same bundle directory (their targets differ), and the first target-only row
    where its bundle has none."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(llama_pair[2], other)
    args = pair.parse_args(["--out", str(tmp_path / "out"),
                            "--draftproof-target", f"t-a={llama_pair[2]}",
                            "--draftproof-target", f"t-b={other}",
                            "--draftproof", f"s-b={other}", "--draftproof", f"s-a={llama_pair[2]}",
                            "--draftproof", f"s-c={other}/."])
    rows = {s.name: s.plain for s in pair.our_systems(args, {"threads": 1})}
    assert rows == {"t-a": None, "t-b": None, "s-b": "t-b", "s-a": "t-a", "s-c": "t-b"}
    args = pair.parse_args(["--out", str(tmp_path / "out"), "--draftproof-target",
                            f"t-a={llama_pair[2]}", "--draftproof", f"s-b={other}"])
    assert [s.plain for s in pair.our_systems(args, {"threads": 1})] == [None, "t-a"]


def test_a_draft_row_whose_plain_row_did_not_run_is_not_a_target_only_row():
    """A peer's draft mode raced without its plain row (--skip): it stays out of the bandwidth
    table (it is no target-only row) and has no "= own greedy" count (nothing to compare)."""
    runs = [r for r in RUNS if r["system"] != "ortgenai"]
    s = pair_report.summarise(runs, SYSTEMS, None)
    assert "ortgenai-draft" in s["all"]
    assert set(pair_report.bandwidth_rows(s, SYSTEMS, gbps=20.0)) == {"hf", "ours-target"}
    assert "ortgenai-draft" not in pair_report.own_greedy(runs, SYSTEMS)
