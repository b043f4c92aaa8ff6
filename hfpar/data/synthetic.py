"""Embedded datasets, generated in memory from a seed: no files, no network.

    from hfpar.data.synthetic import embedded_splits
    splits = embedded_splits("sft", seed=42)    # DatasetDict(train=4000 rows, eval=200 rows)

One generator per recipe kind, each small enough for the tiny character-level model to learn
visibly in about a minute of CPU training:
  sft       `messages` chats. The user asks for one of two string tasks, the assistant answers:
              "count 14 to 19"  -> "14 15 16 17 18 19"   (1-25 numbers: 1 to ~75 completion tokens)
              "repeat k 3"      -> "kkk"                 (1-9 tokens)
            so completions differ a lot in length. A quarter of the chats start with a short system
            message. Counting is learned first (eval loss ~4.9 -> <1 in ~150 steps); copying the
            letter and stopping at the right number take a few hundred steps more.
  clm       `text`: short documents from a small grammar ("the red fox sees a big dog. ...") and
            counting runs ("count 12 13 14 15."), so characters, words and numbers are predictable.
  classify  `text` + `label` (ClassLabel sports/food/weather/music): a few words, most of them from
            the label's topic, the rest fillers and words of other topics. Balanced classes, so the
            majority-class baseline is 25%.
Train and eval are disjoint (no eval text appears in train); the same seed gives the same data.
"""

from __future__ import annotations

import random
import string

from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

N_TRAIN, N_EVAL = 4000, 200
LETTERS = string.ascii_lowercase

# ---------------------------------------------------------------------------------------------- sft
SYSTEM_PROMPTS = ["answer with the result only.", "be exact.", "you are a tiny assistant."]


def _sft_sample(rng: random.Random) -> list[dict]:
    if rng.random() < 0.5:
        a = rng.randint(0, 99)
        b = a + rng.randint(0, 24)
        user, answer = f"count {a} to {b}", " ".join(str(i) for i in range(a, b + 1))
    else:
        ch, n = rng.choice(LETTERS), rng.randint(1, 9)
        user, answer = f"repeat {ch} {n}", ch * n
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.25:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return messages


# ---------------------------------------------------------------------------------------------- clm
ADJ = ["red", "big", "old", "tiny", "lazy", "quick", "green", "happy"]
NOUN = ["fox", "dog", "cat", "bird", "fish", "frog", "horse", "mouse"]
VERB = ["sees", "likes", "chases", "finds", "helps", "follows"]
PLACE = ["in the park", "near the river", "at home", "under a tree"]


def _clm_sample(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.25:
            start = rng.randint(0, 90)
            sentences.append("count " + " ".join(str(i) for i in range(start, start + rng.randint(3, 8))) + ".")
            continue
        s = f"the {rng.choice(ADJ)} {rng.choice(NOUN)} {rng.choice(VERB)} a {rng.choice(ADJ)} {rng.choice(NOUN)}"
        if rng.random() < 0.5:
            s += " " + rng.choice(PLACE)
        sentences.append(s + ".")
    return " ".join(sentences)


# ----------------------------------------------------------------------------------------- classify
TOPICS = {
    "sports": ["goal", "team", "score", "match", "coach", "ball", "race", "player"],
    "food": ["bread", "soup", "apple", "cheese", "rice", "salad", "cake", "pepper"],
    "weather": ["rain", "wind", "cloud", "storm", "snow", "sunny", "fog", "frost"],
    "music": ["song", "drum", "piano", "guitar", "melody", "choir", "violin", "tune"],
}
LABEL_NAMES = list(TOPICS)  # label i = LABEL_NAMES[i]
FILLERS = ["the", "a", "and", "with", "today", "very", "some", "of", "my", "big"]


def _classify_sample(rng: random.Random, label: int) -> str:
    own = [rng.choice(TOPICS[LABEL_NAMES[label]]) for _ in range(rng.randint(2, 4))]
    others = [t for t in LABEL_NAMES if t != LABEL_NAMES[label]]
    noise = [rng.choice(TOPICS[rng.choice(others)]) for _ in range(rng.randint(0, len(own) - 1))]
    words = own + noise + [rng.choice(FILLERS) for _ in range(rng.randint(1, 3))]
    rng.shuffle(words)
    return " ".join(words)


# ------------------------------------------------------------------------------------------ splits
def _draw(make, key, n: int, rng: random.Random, exclude: set, distinct: bool) -> list:
    """n samples from make(rng) whose key is not in exclude (nor repeated, if distinct)."""
    out, seen = [], set(exclude)
    for _ in range(100 * n):
        if len(out) == n:
            return out
        sample = make(rng)
        k = key(sample)
        if k not in seen:
            out.append(sample)
            if distinct:
                seen.add(k)
    raise RuntimeError(f"could not draw {n} samples")  # a generator bug, not a user error


def make_sft(seed: int = 42, n_train: int = N_TRAIN, n_eval: int = N_EVAL) -> DatasetDict:
    rng = random.Random(f"sft-{seed}")
    key = lambda m: m[-2]["content"]  # noqa: E731  (the user request)
    ev = _draw(_sft_sample, key, n_eval, rng, set(), distinct=True)
    tr = _draw(_sft_sample, key, n_train, rng, {key(m) for m in ev}, distinct=False)
    return DatasetDict(train=Dataset.from_dict({"messages": tr}), eval=Dataset.from_dict({"messages": ev}))


def make_clm(seed: int = 42, n_train: int = N_TRAIN, n_eval: int = N_EVAL) -> DatasetDict:
    rng = random.Random(f"clm-{seed}")
    ev = _draw(_clm_sample, str, n_eval, rng, set(), distinct=True)
    tr = _draw(_clm_sample, str, n_train, rng, set(ev), distinct=False)
    return DatasetDict(train=Dataset.from_dict({"text": tr}), eval=Dataset.from_dict({"text": ev}))


def make_classify(seed: int = 42, n_train: int = N_TRAIN, n_eval: int = N_EVAL) -> DatasetDict:
    rng = random.Random(f"classify-{seed}")
    features = Features({"text": Value("string"), "label": ClassLabel(names=LABEL_NAMES)})

    def draw(n: int, exclude: set) -> Dataset:
        labels = [i % len(LABEL_NAMES) for i in range(n)]  # balanced
        rng.shuffle(labels)
        texts, seen = [], set(exclude)
        for lab in labels:
            text = _draw(lambda r: _classify_sample(r, lab), str, 1, rng, seen, distinct=True)[0]
            seen.add(text)
            texts.append(text)
        return Dataset.from_dict({"text": texts, "label": labels}, features=features)

    ev = draw(n_eval, set())
    return DatasetDict(train=draw(n_train, set(ev["text"])), eval=ev)


GENERATORS = {"sft": make_sft, "clm": make_clm, "classify": make_classify}


def embedded_splits(kind: str, seed: int = 42) -> DatasetDict:
    """The embedded DatasetDict(train, eval) for a recipe kind (sft | clm | classify)."""
    return GENERATORS[kind](seed)
