"""Speculative decoding's configuration, the n-gram lookup and its back-off (no model runs but
the refusals)."""

import pytest

from stagewise import LLM, SamplingParams, StagewiseError
from stagewise.engine.request import Request
from stagewise.engine.speculative import SpeculativeConfig, parse_speculative_config
from stagewise.engine.speculative.ngram import MAX_COOLDOWN, NgramProposer, lookup
from stagewise.engine.text_stream import TextStream


def test_three_spellings_give_the_same_config():
    as_dict = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    as_json = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert as_dict == as_json == parse_speculative_config("ngram:3")
    assert parse_speculative_config(None) is None
    draft = parse_speculative_config("draft:/models/d.gguf:2")
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/d.gguf", 2)
    assert parse_speculative_config({"method": "draft", "model": "tiny"}).method == "draft_model"
    assert parse_speculative_config("draft:C:/x/d.gguf").model == "C:/x/d.gguf"  # no k: all path


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "k": 4}, "'k'"),
        ({"method": "ngram", "acceptance": "maximal"}, "acceptance"),
        ("ngram:x", "num_speculative_tokens"),
        ('{"method": ', "JSON"),
        ("medusa:3", "--speculative"),
        ([1, 2], "speculative_config"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_field(value, field):
    with pytest.raises(StagewiseError) as err:
        parse_speculative_config(value)
    message = str(err.value)
    assert field in message and "\n" not in message


@pytest.mark.parametrize("mode", ["kv", "naive"])
def test_modes_other_than_paged_refuse_speculation(tiny, mode):
    with pytest.raises(StagewiseError, match="speculative_config needs mode='paged'"):
        LLM(tiny, mode=mode, speculative_config="ngram:4")


def test_lookup_takes_the_most_recent_earlier_match_and_the_longest_n():
    #        0  1  2  3  4  5  6  7  8  9
    ids = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert lookup(ids, 3, 1, 2) == [8, 2, 5]  # "5 6" last seen at 4: what followed it
    ids = [9, 5, 6, 7, 4, 6, 3, 5, 6]
    assert lookup(ids, 2, 1, 2) == [7, 4]  # n = 2 ("5 6" at 1) beats the later n = 1 ("6" at 5)
    assert lookup(ids, 2, 1, 1) == [3, 5]  # n = 1 only: the most recent "6"
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert lookup([4, 4], 5, 1, 3) == [4]  # the continuation runs into the end: fewer than k
    assert lookup([1, 2, 1], 4, 2, 3) == []  # n = 1 is below the minimum


def request(ids: list[int]) -> Request:
    return Request(
        request_id="r",
        prompt="",
        prompt_token_ids=ids,
        params=SamplingParams(max_tokens=50),
        seed=0,
        text_stream=TextStream(decode=lambda t: ""),
    )


def test_back_off_after_misses_and_regrowth_after_hits():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    req = request([1, 2, 3, 4, 5, 1, 2])
    assert proposer.propose([req], [4])[0].token_ids == [3, 4, 5, 1]

    def verified(drafts: int, accepted: int) -> None:
        req.spec_token_ids, req.last_num_accepted = [0] * drafts, accepted
        proposer.on_verified(req)

    verified(4, 0)  # a miss: one step off, then half as many guesses
    assert proposer.propose([req], [4])[0].token_ids == []
    assert proposer.propose([req], [4])[0].token_ids == [3, 4]
    verified(2, 0)  # a second miss in a row: two steps off
    assert [proposer.propose([req], [4])[0].token_ids for _ in range(3)] == [[], [], [3]]
    verified(1, 1)  # all kept: twice as many next time
    assert proposer.propose([req], [4])[0].token_ids == [3, 4]
    verified(2, 2)
    assert proposer.propose([req], [4])[0].token_ids == [3, 4, 5, 1]
    for _ in range(10):
        verified(1, 0)
    assert proposer._state["r"].cooldown == MAX_COOLDOWN
    proposer.on_removed(req)
    assert proposer.propose([req], [2])[0].token_ids == [3, 4]  # a fresh start
    static = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, adaptive=False))
    req.spec_token_ids, req.last_num_accepted = [0, 0], 0
    static.on_verified(req)
    assert static.propose([req], [4])[0].token_ids == [3, 4, 5, 1]
