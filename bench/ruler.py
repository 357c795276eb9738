"""RULER-style long-context tasks, generated offline: needles in a haystack, variable tracking,
common and frequent words extraction, each at a length measured in the model's tokens.

Every sample is a user message (``prompt``; the runner applies the model's chat template), the
start of the answer (``answer_prefix``, appended after the template's assistant header, so that a
small model answers in the expected form), the strings the answer must contain (``answers``) and
the tokens its generation may take (``max_new_tokens``). ``score(output, answers)`` is the
fraction of the expected strings found in the output (case-insensitive substring match), RULER's
"all" string match.

Tasks (``TASKS``):

    niah_single       one "magic number" for a key, hidden in a haystack of a few filler
                      sentences repeated; asked for that key's number.
    niah_single_text  the same in neutral generated text (random sentences from small word lists).
    niah_multikey     four needles with different keys in generated text; asked for one of them.
    niah_multivalue   four needles with the same key and different numbers; asked for all four.
    vt                variable tracking: ``VAR ABCDE = 12345.`` then ``VAR FGHIJ = VAR ABCDE.``
                      and so on (four hops) among filler sentences; asked for every variable that
                      holds the number (five names).
    cwe               common words extraction: a numbered list of made-up words where ten words
                      appear many times and the others a few times; asked for the ten.
    fwe               frequent words extraction: a text of made-up "coded" words drawn from a
                      Zipf distribution (exponent 2); asked for the three most frequent.

Deterministic: a sample depends on (task, length, index, seed) and the tokenizer only (its RNG
is seeded from a hash of the four). Its length: ``tokenizer.encode(prompt)`` plus the answer
prefix's tokens land within ``LENGTH_TOLERANCE`` below ``length - reserve`` (never above), where
``reserve`` is what the caller keeps for the chat template and the generated tokens. The size of a
task's filler is found by a few secant steps on the token count (two or three encodes a sample).
No text comes from outside this file: the words, the filler sentences and the made-up words are
generated here, so the tasks run with no download.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

LENGTH_TOLERANCE = 0.02  # a sample's tokens lie in [(1 - tol) * target, target]
MAX_FIT_STEPS = 12


class Tokenizer(Protocol):
    def encode(self, text: str) -> Sequence: ...


@dataclass(frozen=True)
class Sample:
    """One task instance. ``tokens``: the tokens of ``prompt`` and ``answer_prefix`` (encoded
    apart), the length the generator fitted; ``info``: where the task put what it asks for
    (character offsets into ``prompt``, depths as fractions of the haystack)."""

    task: str
    length: int
    index: int
    seed: int
    prompt: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    tokens: int
    info: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Task:
    name: str
    max_new_tokens: int
    description: str
    build: Callable[[random.Random, int], "_Built"]  # (rng, size knob) -> the sample's text


@dataclass
class _Built:
    prompt: str
    answer_prefix: str
    answers: tuple[str, ...]
    info: dict


def score(output: str, answers: Sequence[str]) -> float:
    """The fraction (0..1) of ``answers`` found in ``output``, ignoring case."""
    if not answers:
        raise ValueError("score needs at least one expected answer")
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


# ---- words ------------------------------------------------------------------------------------
ADJECTIVES = (
    "amber", "ancient", "bitter", "brave", "bright", "broad", "calm", "clever", "cold", "copper", "crimson",
    "curious", "damp", "distant", "dusty", "eager", "early", "empty", "faint", "fierce", "gentle", "golden",
    "grand", "green", "grey", "hidden", "hollow", "humble", "icy", "idle", "jolly", "keen", "late", "lazy",
    "little", "lively", "lonely", "loud", "lucky", "mellow", "misty", "narrow", "noble", "odd", "pale", "plain",
    "polite", "proud", "quiet", "rapid", "rare", "rough", "round", "rusty", "sandy", "scarlet", "sharp", "shiny",
    "silent", "silver", "slow", "small", "smooth", "soft", "steady", "stormy", "sunny", "swift", "tall", "tame",
    "tidy", "tiny", "vast", "velvet", "warm", "wild", "windy", "wise", "wooden", "young",
)
NOUNS = (
    "anchor", "apple", "arrow", "badger", "banner", "barrel", "basket", "beacon", "bell", "bench", "berry",
    "blanket", "bottle", "bridge", "brook", "bucket", "cabin", "camel", "candle", "canyon", "carpet", "castle",
    "cedar", "chair", "cherry", "chimney", "clock", "cloud", "comet", "compass", "cottage", "crane", "crystal",
    "daisy", "desert", "dolphin", "door", "dragon", "drum", "eagle", "engine", "falcon", "feather", "fern",
    "fiddle", "field", "forest", "fountain", "fox", "garden", "glacier", "goat", "harbor", "harp", "hawk",
    "helmet", "hill", "island", "jacket", "kettle", "kite", "ladder", "lantern", "lemon", "lily", "lizard",
    "magnet", "maple", "marble", "meadow", "mirror", "mitten", "monkey", "moon", "mountain", "needle", "nest",
    "oak", "ocean", "orchard", "otter", "owl", "paddle", "parrot", "pebble", "pencil", "pepper", "piano",
    "pillow", "pine", "planet", "pocket", "pond", "puzzle", "quarry", "rabbit", "raven", "ribbon", "river",
    "rocket", "saddle", "sail", "shell", "shovel", "signal", "spoon", "squirrel", "stone", "street", "summit",
    "table", "teapot", "thimble", "thunder", "tiger", "timber", "tower", "trumpet", "tulip", "tunnel", "turtle",
    "valley", "violin", "wagon", "walnut", "whistle", "willow", "window", "wizard", "wolf", "zebra",
)
VERBS = (
    "rested", "waited", "turned", "settled", "leaned", "drifted", "stayed", "appeared", "gleamed", "shifted",
    "paused", "lingered", "faded", "wandered", "glowed", "swayed", "returned", "vanished", "sparkled", "dozed",
)
# The repeated haystack: four plain sentences, cycled.
FILLER = (
    "The lake lies still under a pale sky.",
    "A cart rolls slowly down the long road.",
    "Smoke rises from the chimneys of the village.",
    "Day follows night, and the seasons turn again.",
)
_TEXT_TEMPLATES = (
    "The {a} {n} {v} near the {n2}.",
    "A {a} {n} {v} beside the {a2} {n2}.",
    "Nobody noticed when the {n} {v} by the {n2}.",
    "Later that day the {a} {n} {v} again.",
    "Every {n} in the {n2} {v} for a while.",
    "The {n2} looked {a} once the {n} {v}.",
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _pseudo_word(rng: random.Random) -> str:
    """A made-up word of three consonant-vowel syllables (all six letters long, so that no word
    is a substring of another)."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    out: dict[str, None] = {}
    while len(out) < n:
        out[_pseudo_word(rng)] = None
    return list(out)


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` different keys such as ``silver-lantern``."""
    out: dict[str, None] = {}
    while len(out) < n:
        out[f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"] = None
    return list(out)


def _generated_sentence(rng: random.Random) -> str:
    n, n2 = rng.sample(NOUNS, 2)
    a, a2 = rng.sample(ADJECTIVES, 2)
    return rng.choice(_TEXT_TEMPLATES).format(a=a, a2=a2, n=n, n2=n2, v=rng.choice(VERBS))


def _haystack(rng: random.Random, n: int, kind: str) -> list[str]:
    if kind == "repeat":
        return [FILLER[i % len(FILLER)] for i in range(n)]
    return [_generated_sentence(rng) for _ in range(n)]


def _insert(sentences: list[str], inserts: list[tuple[float, str]]) -> tuple[str, list[int], list[float]]:
    """``sentences`` joined by spaces with each ``(depth, text)`` put between sentences at
    ``depth`` (0: before the first, 1: after the last). Returns the text, each insert's character
    offset in it and its actual depth (offset / length of the text), in the order given."""
    n = len(sentences)
    slots = [min(n, max(0, round(d * n))) for d, _ in inserts]
    order = sorted(range(len(inserts)), key=lambda i: (slots[i], i))
    pieces, offsets, pos, done = [], [0] * len(inserts), 0, 0
    for i in order:
        for s in sentences[done:slots[i]]:
            pieces.append(s)
            pos += len(s) + 1
        done = slots[i]
        offsets[i] = pos
        pieces.append(inserts[i][1])
        pos += len(inserts[i][1]) + 1
    pieces.extend(sentences[done:])
    text = " ".join(pieces)
    return text, offsets, [o / max(1, len(text)) for o in offsets]


# ---- the tasks --------------------------------------------------------------------------------
_NIAH_HEAD = ("Some magic numbers are hidden in the text below. Read it carefully: afterwards you will be "
              "asked about them.\n\n")


def _needle(key: str, value: str) -> str:
    return f"Remember this: the magic number for {key} is {value}."


def _niah(rng: random.Random, n: int, *, haystack: str, keys: int, values: int) -> _Built:
    """``keys`` needles with different keys (one asked), or ``values`` needles of one key (all
    asked). Depths and keys are drawn before the haystack so that they do not depend on ``n``."""
    names = _keys(rng, keys)
    asked = rng.randrange(keys)
    if values > 1:
        pairs = [(names[0], _number(rng, 7)) for _ in range(values)]
        while len({v for _, v in pairs}) < values:
            pairs = [(names[0], _number(rng, 7)) for _ in range(values)]
    else:
        pairs = [(k, _number(rng, 7)) for k in names]
    depths = [rng.random() for _ in pairs]
    sentences = _haystack(rng, n, haystack)
    needles = [_needle(k, v) for k, v in pairs]
    body, offsets, actual = _insert(sentences, list(zip(depths, needles)))
    key = names[asked] if values == 1 else names[0]
    if values > 1:
        question = f"What are all the magic numbers for {key} in the text above? List every one of them."
        prefix, answers = f"The magic numbers for {key} are", tuple(v for _, v in pairs)
    else:
        question = f"What is the magic number for {key} in the text above?"
        prefix, answers = f"The magic number for {key} is", (pairs[asked][1],)
    prompt = _NIAH_HEAD + body + "\n\n" + question
    start = len(_NIAH_HEAD)
    info = {"key": key, "needles": [{"text": t, "offset": start + o, "depth": round(d, 4), "asked": (
        values > 1 or i == asked)} for i, (t, o, d) in enumerate(zip(needles, offsets, actual))],
        "haystack": haystack, "haystack_sentences": n}
    return _Built(prompt, prefix, answers, info)


_VT_HEAD = ("Below is a text with some variable assignments hidden in it. Keep track of which variables "
            "hold which values.\n\n")


def _vt(rng: random.Random, n: int, hops: int = 4) -> _Built:
    """One chain: ``VAR A = value.``, then ``VAR B = VAR A.`` and so on for ``hops`` hops, at
    increasing depths among repeated filler sentences."""
    names: dict[str, None] = {}
    while len(names) < hops + 1:
        names["".join(rng.choice(string.ascii_uppercase) for _ in range(5))] = None
    chain = list(names)
    value = _number(rng, 5)
    lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i + 1]} = VAR {chain[i]}." for i in range(hops)]
    depths = sorted(rng.random() for _ in lines)
    body, offsets, actual = _insert(_haystack(rng, n, "repeat"), list(zip(depths, lines)))
    prompt = (_VT_HEAD + body + "\n\n" + f"Which variables hold the value {value} in the text above, directly "
              "or through other variables? Name all of them.")
    info = {"value": value, "chain": chain, "statements": [
        {"text": t, "offset": len(_VT_HEAD) + o, "depth": round(d, 4)} for t, o, d in zip(lines, offsets, actual)],
        "haystack_sentences": n}
    return _Built(prompt, f"The variables that hold {value} are", tuple(chain), info)


_CWE_HEAD = "Below is a numbered list of words. Some words appear in it many times.\n\n"
COMMON_WORDS = 10


def cwe_frequencies(entries: int) -> tuple[int, int]:
    """(times each common word appears, times each other word appears) in a list of about
    ``entries`` entries: 30 and 3 in a long list, fewer in a short one (the common words always
    appear more often than the others)."""
    common = max(2, min(30, entries // 25))
    return common, (3 if common >= 10 else 1)


def _cwe(rng: random.Random, n: int) -> _Built:
    """A list of ``n`` entries (about): ``COMMON_WORDS`` words ``common`` times each, the rest
    of the entries words that appear ``rare`` times each, shuffled."""
    common, rare = cwe_frequencies(n)
    others = max(0, (n - COMMON_WORDS * common) // rare)
    words = _pseudo_words(rng, COMMON_WORDS + others)
    top, rest = words[:COMMON_WORDS], words[COMMON_WORDS:]
    entries = [w for w in top for _ in range(common)] + [w for w in rest for _ in range(rare)]
    rng.shuffle(entries)
    listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
    prompt = (_CWE_HEAD + listing + "\n\n" + f"Which {COMMON_WORDS} words appear most often in the list above? "
              "Name all of them.")
    info = {"entries": len(entries), "common_times": common, "other_times": rare, "counts": dict(Counter(entries))}
    return _Built(prompt, f"The {COMMON_WORDS} most common words in the list are", tuple(top), info)


_FWE_HEAD = ("Below is a text written in coded words. Count how often each coded word occurs.\n\n")
FWE_ALPHA = 2.0
FWE_TOP = 3
FWE_LINE = 12


def fwe_counts(words: int, alpha: float = FWE_ALPHA) -> list[int]:
    """How often each word of the vocabulary (rank 1 first) occurs in a text of about ``words``
    words: proportional to rank ** -alpha, at least once, and the top ``FWE_TOP`` strictly more
    often than the next (so that the answer is unique)."""
    vocab = max(FWE_TOP + 2, words // 10)
    weights = [r ** -alpha for r in range(1, vocab + 1)]
    total = sum(weights)
    counts = [max(1, int(words * w / total)) for w in weights]
    for i in range(FWE_TOP, 0, -1):  # ranks FWE_TOP .. 1 above the next: bump from the bottom up
        if counts[i - 1] <= counts[i]:
            counts[i - 1] = counts[i] + 1
    return counts


def _fwe(rng: random.Random, n: int) -> _Built:
    counts = fwe_counts(n)
    vocab = _pseudo_words(rng, len(counts))
    text = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(text)
    lines = [" ".join(text[i:i + FWE_LINE]) + " ." for i in range(0, len(text), FWE_LINE)]
    prompt = (_FWE_HEAD + "\n".join(lines) + "\n\n" + f"Which {FWE_TOP} coded words occur most often in the text "
              "above? Name them.")
    info = {"words": len(text), "vocabulary": len(vocab), "top_counts": counts[:FWE_TOP + 1]}
    return _Built(prompt, f"The {FWE_TOP} most frequent coded words are", tuple(vocab[:FWE_TOP]), info)


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("niah_single", 24, "one needle in repeated filler sentences",
         lambda rng, n: _niah(rng, n, haystack="repeat", keys=1, values=1)),
    Task("niah_single_text", 24, "one needle in generated text",
         lambda rng, n: _niah(rng, n, haystack="text", keys=1, values=1)),
    Task("niah_multikey", 24, "four needles with different keys in generated text, one asked",
         lambda rng, n: _niah(rng, n, haystack="text", keys=4, values=1)),
    Task("niah_multivalue", 48, "four numbers for one key in generated text, all asked",
         lambda rng, n: _niah(rng, n, haystack="text", keys=1, values=4)),
    Task("vt", 64, "variable tracking: a chain of five variables among filler sentences", _vt),
    Task("cwe", 64, "the ten most common words of a numbered list", _cwe),
    Task("fwe", 32, "the three most frequent words of a coded text", _fwe),
)}


# ---- fitting the length -----------------------------------------------------------------------
def sample_seed(task: str, length: int, index: int, seed: int) -> int:
    """The RNG seed of one sample: a hash of its four coordinates (stable across runs and
    machines, unlike ``hash()``)."""
    digest = hashlib.sha256(f"{task}|{length}|{index}|{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _count(tokenizer: Tokenizer, built: _Built) -> int:
    return len(tokenizer.encode(built.prompt)) + len(tokenizer.encode(built.answer_prefix))


def make_sample(task: str, length: int, index: int, *, tokenizer: Tokenizer, seed: int = 0,
                reserve: int = 0) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens: its prompt and answer prefix take
    between ``(1 - LENGTH_TOLERANCE) * (length - reserve)`` and ``length - reserve`` tokens.
    ValueError when the task's fixed text alone does not fit."""
    spec = TASKS.get(task)
    if spec is None:
        raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")
    target = int(length) - int(reserve)
    rng_seed = sample_seed(task, length, index, seed)

    def build(n: int) -> _Built:
        return spec.build(random.Random(rng_seed), n)

    floor = int(target * (1 - LENGTH_TOLERANCE))
    base = _count(tokenizer, build(0))
    if base >= floor:
        raise ValueError(f"task {task}: {length} tokens (less {reserve} reserved) is too short: its fixed text "
                         f"alone takes {base} tokens")
    # A probe of a fixed size gives the first rate: the search's path, and so the sample, depends
    # on the sample's coordinates and the tokenizer only.
    probe = 64
    rate = max(1e-3, (_count(tokenizer, build(probe)) - base) / probe)
    n = max(1, int((target - base) / rate))
    best: tuple[int, int, _Built] | None = None  # (tokens, n, built) of the largest fit so far
    tried: dict[int, int] = {}
    for _ in range(MAX_FIT_STEPS):
        built = build(n)
        t = _count(tokenizer, built)
        tried[n] = t
        if t <= target and (best is None or t > best[0]):
            best = (t, n, built)
        if floor <= t <= target:
            break
        rate = max(1e-3, (t - base) / n)
        step = int((target - t) / rate)
        nxt = n + (step if step else (1 if t < floor else -1))
        while nxt in tried and nxt > 0:  # do not cycle between two sizes around the target
            nxt += 1 if t < floor else -1
        if nxt <= 0:
            break
        n = nxt
    if best is None:
        raise ValueError(f"task {task}: could not fit {length} tokens (less {reserve} reserved)")
    t, n, built = best
    info = dict(built.info, size=n, tokens_per_unit=round((t - base) / max(1, n), 4))
    return Sample(task=task, length=int(length), index=int(index), seed=int(seed), prompt=built.prompt,
                  answer_prefix=built.answer_prefix, answers=built.answers, max_new_tokens=spec.max_new_tokens,
                  tokens=t, info=info)


def make_samples(task: str, length: int, count: int, *, tokenizer: Tokenizer, seed: int = 0, reserve: int = 0,
                 start: int = 0) -> list[Sample]:
    """Samples ``start .. start + count - 1`` of one task and length (``make_sample`` each)."""
    return [make_sample(task, length, i, tokenizer=tokenizer, seed=seed, reserve=reserve)
            for i in range(start, start + count)]


__all__ = ["COMMON_WORDS", "LENGTH_TOLERANCE", "Sample", "TASKS", "Task", "cwe_frequencies", "fwe_counts",
           "make_sample", "make_samples", "sample_seed", "score"]
