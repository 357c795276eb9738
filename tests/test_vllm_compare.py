"""The rule by which the plugin's GPU test compares two engines' greedy generations
(``vllm_engine.compare_generations``), on records shaped like the engines' own."""

from __future__ import annotations

import copy

import pytest

from vllm_engine import compare_generations

TOL, TIE = 0.08, 0.16


def _request(tokens, runner_up=None, logprobs=None, gap=0.5):
    """A record of greedy ``tokens``: the picked token at logprob -1 (or ``logprobs``), a runner-up
    ``gap`` below it."""
    steps = []
    for i, t in enumerate(tokens):
        lp = -1.0 if logprobs is None else logprobs[i]
        other = (runner_up or {}).get(i, 1000 + i)
        steps.append({str(t): lp, str(other): lp - gap})
    return {"tokens": list(tokens), "logprobs": steps}


def _ref():
    return [_request([5, 6, 7, 8]), _request([9, 10, 11, 12])]


def test_equal_generations_compare_every_step():
    assert compare_generations(_ref(), _ref(), logprob_tol=TOL, tie=TIE) == 8


def test_a_pick_between_tied_tokens_may_go_either_way():
    """The reference's step 1 of request 0 is an exact tie of 6 and 42; ours takes 42 and goes
    on differently."""
    ref = _ref()
    ref[0]["logprobs"][1] = {"6": -3.874, "42": -3.874}
    ours = copy.deepcopy(ref)
    ours[0]["tokens"] = [5, 42, 70, 71]
    ours[0]["logprobs"][1:] = [{"42": -3.85, "6": -3.88}, {"70": -2.0, "1": -3.0}, {"71": -2.0, "1": -3.0}]
    assert compare_generations(ours, ref, logprob_tol=TOL, tie=TIE) == 5


def test_another_token_without_a_tie_fails():
    ref, ours = _ref(), _ref()
    ours[1]["tokens"][2] = 1002  # the reference's runner-up, 0.5 below
    ours[1]["logprobs"][2] = {"1002": -1.0, "11": -1.5}
    with pytest.raises(AssertionError, match="reference margin 0.500"):
        compare_generations(ours, ref, logprob_tol=TOL, tie=TIE)


def test_a_token_outside_the_reference_top_fails():
    ref, ours = _ref(), _ref()
    ours[0]["tokens"][0] = 77
    ours[0]["logprobs"][0] = {"77": -1.0, "5": -1.1}
    with pytest.raises(AssertionError, match="not in the reference's top"):
        compare_generations(ours, ref, logprob_tol=TOL, tie=TIE)


def test_a_logprob_off_by_more_than_the_tolerance_fails():
    ref = _ref()
    ours = copy.deepcopy(ref)
    ours[1]["logprobs"][3]["12"] = -1.0 - 1.5 * TOL
    with pytest.raises(AssertionError, match="request 1 step 3: logprob"):
        compare_generations(ours, ref, logprob_tol=TOL, tie=TIE)


def test_a_tied_pick_with_a_wrong_logprob_fails():
    ref = _ref()
    ref[0]["logprobs"][1] = {"6": -3.874, "42": -3.874}
    ours = copy.deepcopy(ref)
    ours[0]["tokens"][1] = 42
    ours[0]["logprobs"][1] = {"42": -3.5, "6": -3.9}
    with pytest.raises(AssertionError, match="logprob of 42"):
        compare_generations(ours, ref, logprob_tol=TOL, tie=TIE)


def test_runs_that_part_at_their_first_steps_fail():
    ref = [_request([5, 6, 7, 8], gap=0.01), _request([9, 10, 11, 12], gap=0.01)]
    ours = copy.deepcopy(ref)
    for r, req in enumerate(ours):
        other = 1000  # the runner-up of step 0
        req["tokens"] = [other, 1, 2, 3]
        req["logprobs"] = [{str(other): -1.01, str(ref[r]["tokens"][0]): -1.02}] + ref[r]["logprobs"][1:]
    with pytest.raises(AssertionError, match="only 0 of 8 steps compared"):
        compare_generations(ours, ref, logprob_tol=TOL, tie=TIE)


def test_a_missing_request_or_token_fails():
    with pytest.raises(AssertionError, match="1 requests against 2"):
        compare_generations(_ref()[:1], _ref(), logprob_tol=TOL, tie=TIE)
    short = _ref()
    short[0]["tokens"] = short[0]["tokens"][:3]
    with pytest.raises(AssertionError, match="3 tokens vs 4"):
        compare_generations(short, _ref(), logprob_tol=TOL, tie=TIE)
