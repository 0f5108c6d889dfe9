"""A request's statistics are one frozen record (decode.stats): what the CLI's --json prints, the
server's `draftproof` field and /metrics are all read from it, and a transcription's are its
windows' decodes added up."""

import dataclasses
import json
from pathlib import Path

import pytest

from spec_runtime.decode.stats import API, Counts, GenerationStats, summed
from spec_runtime.longform import TranscriptStats

ROOT = Path(__file__).resolve().parent.parent


def test_a_record_is_frozen_and_its_rates_are_made_of_its_counts():
    s = GenerationStats(mode="speculative", new_tokens=30, target_calls=12, proposed=40,
                        accepted=18, wall_time_s=0.6, gammas_used=(4, 4, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.accepted = 0
    assert (s.acceptance_rate, s.tokens_per_target_call, s.tokens_per_s, s.mean_gamma) == \
        (18 / 40, 30 / 12, 30 / 0.6, 10 / 3)
    again = dataclasses.replace(s, accepted=40)  # a changed count changes its rates
    assert again.acceptance_rate == 1.0 and s.acceptance_rate == 18 / 40
    empty = GenerationStats()
    assert (empty.acceptance_rate, empty.tokens_per_target_call, empty.tokens_per_s) == (0, 0, 0)


def test_windows_add_up_to_a_transcripts_counts_by_hand():
    a = GenerationStats(new_tokens=7, prompt_tokens=4, target_calls=3, proposed=9, accepted=5,
                        accepted_by_position=((3, 2), (2, 2), (2, 1)), encode_time_s=0.25,
                        wall_time_s=1.0)
    b = GenerationStats(new_tokens=5, prompt_tokens=6, target_calls=4, proposed=4, accepted=1,
                        accepted_by_position=((4, 1),), encode_time_s=0.5, wall_time_s=0.5)
    t = TranscriptStats(mode="speculative", **summed([a, b]), windows=2, seconds=2.0)
    assert (t.new_tokens, t.prompt_tokens, t.target_calls, t.proposed, t.accepted) == \
        (12, 10, 7, 13, 6)
    assert t.accepted_by_position == ((7, 3), (2, 2), (2, 1))
    assert (t.encode_time_s, t.wall_time_s) == (0.75, 1.5)
    assert t.acceptance_rate == 6 / 13 and t.tokens_per_target_call == 12 / 7
    assert summed([]) == {"new_tokens": 0, "prompt_tokens": 0, "target_calls": 0, "proposed": 0,
                          "accepted": 0, "encode_time_s": 0, "wall_time_s": 0,
                          "accepted_by_position": ()}


def test_the_json_and_the_responses_field_are_the_records_fields():
    s = GenerationStats(mode="speculative", draft_kind="ngram", accepted_by_position=((2, 1),),
                        draft_rounds={"ngram": 2}, gammas_used=(3, 1))
    out = json.loads(json.dumps(s.to_json()))
    assert set(out) == {f.name for f in dataclasses.fields(GenerationStats)}
    assert out["accepted_by_position"] == [[2, 1]] and out["gammas_used"] == [3, 1]
    marked = {f.name for f in dataclasses.fields(GenerationStats) if f.metadata == API}
    assert set(s.api()) == marked and "accepted_by_position" not in marked
    # what a transcription's response carries is the shared part's
    assert set(TranscriptStats().api()) == {f.name for f in dataclasses.fields(Counts)
                                            if f.metadata == API}


def test_the_serving_page_names_every_field_of_the_responses_statistics():
    page = (ROOT / "docs" / "serving.md").read_text()
    start = page.index("the response's `draftproof` field")
    said = page[start:page.index("\n- **", start)]
    missing = [k for k in GenerationStats().api() if f"`{k}`" not in said]
    assert missing == [], f"docs/serving.md does not name {missing}"
