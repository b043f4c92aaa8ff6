"""Preference data (DPO): TRL's formats -> (prompt_ids, chosen_ids, rejected_ids) -> one row per pair.

    splits = make_preference(seed=42)                           # the embedded set (conversational, explicit prompt)
    train, stats = tokenize_preference(splits["train"], tok, max_length=128)
    batch = PairCollator(tok)([train[i] for i in range(8)])      # input_ids, labels, position_ids, token_mask
    with_attention_mask(batch)                                   # share_prompt: pair_layout -> its (B, 1, T, T) mask

Formats (TRL's): columns prompt / chosen / rejected, standard (strings) or conversational (lists of
{"role", "content"} messages), or chosen / rejected only (implicit prompt: their longest common prefix, as
trl.data_utils.extract_prompt). Tokenized as TRL 1.16's DPOTrainer._prepare_dataset does: standard text gets
the eos appended to each completion; the completion starts where the tokenized prompt and prompt + completion
first differ. Truncation: --max_prompt_length keeps the prompt's end and --max_completion_length the
completion's start (TRL <= 0.x's per-part limits); then --max_length cuts prompt + completion (TRL 1.16's
DataCollatorForPreference: keep_start, or keep_end). A prompt that fills max_length alone (keep_start) is
refused (TRL drops it silently).

Row layout: each pair is ONE row, its two sequences packed as documents (position ids restart at 0 at the
rejected one): the chosen and rejected sequences of a pair always travel together, through context-parallel
shards and pipeline micro-batches alike (with a shared prompt, several pairs share a row: PairCollator).
Labels carry the pair with each target (encode_targets): pair index in the batch, side (chosen / rejected) and
token, IGNORE outside completions; so every cut of a batch keeps each target next to its pair.
why: docs/architecture.md#why-loading-data-and-the-planner
"""

from __future__ import annotations

import random

import torch
from datasets import Dataset, DatasetDict

from hfpar.data.synthetic import LETTERS, _sft_sample
from hfpar.parallel.labels import IGNORE

from .errors import DataError
from .load import _load_raw

N_TRAIN, N_EVAL = 2000, 100
COLUMNS = ("prompt", "chosen", "rejected")

_STRIDE = 1 << 32  # token ids below it (any vocabulary); (2 * row + side + 1) * _STRIDE above


def encode_targets(token, row, side):
    """A completion label carrying its pair: token + (2 * row + side + 1) * 2^32 (side 0 chosen, 1 rejected); works on
    ints and tensors alike."""
    return token + (2 * row + side + 1) * _STRIDE


def decode_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """labels (..., ) -> (token, sequence, valid): sequence = 2 * row + side of the batch, token IGNORE-free
    (0 where not valid)."""
    valid = labels >= _STRIDE
    seq = torch.where(valid, labels // _STRIDE - 1, 0)
    token = torch.where(valid, labels % _STRIDE, 0)
    return token, seq, valid


# ------------------------------------------------------------------------------------ embedded set
def _wrong_answer(user: str, rng: random.Random) -> str:
    """A plausible wrong answer to the synthetic sft task: off by one at an end, a skipped number, or the wrong
    letter / count."""
    words = user.split()
    if words[0] == "count":
        a, b = int(words[1]), int(words[3])
        nums = list(range(a, b + 1))
        choice = rng.randrange(3)
        if choice == 0 or len(nums) < 3:
            nums = nums + [b + 1] if rng.random() < 0.5 or len(nums) == 1 else nums[:-1]
        elif choice == 1:
            del nums[rng.randrange(1, len(nums) - 1)]
        else:
            nums = [a + 1] + nums[1:] if rng.random() < 0.5 else nums[:1] + [n + 1 for n in nums[1:]]
        return " ".join(str(n) for n in nums)
    ch, n = words[1], int(words[2])
    if rng.random() < 0.5:
        return ch * (n + 1 if n == 1 or rng.random() < 0.5 else n - 1)
    return rng.choice([c for c in LETTERS if c != ch]) * n


def _pair(rng: random.Random) -> dict:
    messages = _sft_sample(rng)
    right = messages[-1]["content"]
    wrong = _wrong_answer(messages[-2]["content"], rng)
    return {
        "prompt": messages[:-1],
        "chosen": [{"role": "assistant", "content": right}],
        "rejected": [{"role": "assistant", "content": wrong}],
    }


def make_preference(seed: int = 42, n_train: int = N_TRAIN, n_eval: int = N_EVAL) -> DatasetDict:
    """Pairs from the sft generator's tasks: chosen = the right answer, rejected = a plausible wrong one. Eval prompts
    do not occur in train."""
    rng = random.Random(f"dpo-{seed}")
    ev, seen = [], set()
    while len(ev) < n_eval:
        p = _pair(rng)
        key = p["prompt"][-1]["content"]
        if key not in seen:
            seen.add(key)
            ev.append(p)
    tr = []
    while len(tr) < n_train:
        p = _pair(rng)
        if p["prompt"][-1]["content"] not in seen:
            tr.append(p)
    return DatasetDict(train=Dataset.from_list(tr), eval=Dataset.from_list(ev))


# ------------------------------------------------------------------------------------ formats
def is_conversational(example: dict) -> bool:
    """As trl.data_utils.is_conversational for prompt / chosen / rejected."""
    v = next((example[k] for k in COLUMNS if k in example), None)
    return isinstance(v, list) and len(v) > 0 and isinstance(v[0], dict) and "role" in v[0]


def extract_prompt(example: dict) -> dict:
    """As trl.data_utils.extract_prompt: the longest common prefix of chosen and rejected (whole messages for
    conversational data; for text, cut at the last whitespace before they differ)."""
    c, r = example["chosen"], example["rejected"]
    n = 0
    for n in range(min(len(c), len(r))):
        if c[n] != r[n]:
            break
    else:
        n = min(len(c), len(r))
    if isinstance(c, str) and n > 0:  # TRL: back off to the last space so no word is split
        while n > 0 and c[n - 1] != " ":
            n -= 1
        n = max(n - 1, 0) if n > 0 else 0
    return {"prompt": c[:n], "chosen": c[n:], "rejected": r[n:]}


def check_columns(ds: Dataset, name: str) -> None:
    cols = set(ds.column_names)
    missing = [c for c in ("chosen", "rejected") if c not in cols]
    if missing:
        raise DataError(
            f"preference dataset {name}: no {' / '.join(missing)} column (have {', '.join(sorted(cols))}); "
            "expected prompt / chosen / rejected (standard or conversational) or chosen / rejected"
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ids(tok, x) -> list[int]:
    if isinstance(x, list):
        return list(tok.apply_chat_template(x, tokenize=True, return_dict=True)["input_ids"])
    return list(tok(text=x)["input_ids"])


def tokenize_pair(example: dict, tok, index: int) -> dict:
    """One example -> prompt_ids, chosen_ids, rejected_ids (TRL 1.16's tokenize_fn)."""
    for k in ("chosen", "rejected"):
        v = example.get(k)
        if v is None or (isinstance(v, (str, list)) and len(v) == 0):
            raise DataError(f"preference example {index}: empty or missing {k!r}")
    if "prompt" not in example or example["prompt"] is None:
        example = extract_prompt(example)
        if not example["chosen"] or not example["rejected"]:
            raise DataError(f"preference example {index}: chosen and rejected are identical after the common prompt")
    conv = is_conversational(example)
    if conv:
        prompt = list(
            tok.apply_chat_template(example["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
        pc = _ids(tok, example["prompt"] + example["chosen"])
        pr = _ids(tok, example["prompt"] + example["rejected"])
    else:
        eos = tok.eos_token or ""
        c, r = example["chosen"], example["rejected"]
        c, r = c if c.endswith(eos) else c + eos, r if r.endswith(eos) else r + eos
        prompt, pc, pr = (
            _ids(tok, example["prompt"]),
            _ids(tok, example["prompt"] + c),
            _ids(tok, example["prompt"] + r),
        )
    n = min(_common_prefix(prompt, pc), _common_prefix(prompt, pr))
    out = {"prompt_ids": prompt[:n], "chosen_ids": pc[n:], "rejected_ids": pr[n:]}
    for k in ("chosen_ids", "rejected_ids"):
        if not out[k]:
            raise DataError(f"preference example {index}: the {k[:-4]} completion has no tokens")
    return out


def truncate_pair(
    p: dict,
    *,
    max_length: int | None,
    truncation_mode: str = "keep_start",
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
) -> dict:
    """-> {"chosen": (ids, completion_mask), "rejected": (...)}: each sequence prompt + completion, truncated."""
    prompt = p["prompt_ids"][-max_prompt_length:] if max_prompt_length else p["prompt_ids"]
    out = {}
    for side in ("chosen", "rejected"):
        comp = p[f"{side}_ids"][:max_completion_length] if max_completion_length else p[f"{side}_ids"]
        ids, mask = prompt + comp, [0] * len(prompt) + [1] * len(comp)
        if max_length is not None:
            sl = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[sl], mask[sl]
        out[side] = (ids, mask)
    return out


def tokenize_preference(
    ds: Dataset,
    tok,
    max_length: int | None,
    *,
    truncation_mode: str = "keep_start",
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    truncation: str = "truncate",
    name: str = "train",
) -> tuple[Dataset, dict]:
    """Tokenized pairs (prompt_ids, chosen_ids, rejected_ids and, when present, ref_chosen_logps /
    ref_rejected_logps); truncation "drop": a pair longer than the limits is refused, naming the example."""
    check_columns(ds, name)
    if truncation_mode not in ("keep_start", "keep_end"):
        raise DataError(f"--truncation_mode {truncation_mode!r}: valid values are keep_start, keep_end")
    rows, cut = [], 0
    for i, ex in enumerate(ds):
        p = tokenize_pair(dict(ex), tok, i)
        if max_length is not None and truncation_mode == "keep_start" and len(p["prompt_ids"]) >= max_length:
            raise DataError(
                f"preference example {i}: its prompt alone has {len(p['prompt_ids'])} tokens, "
                f"--max_length {max_length} leaves no completion token (raise --max_length)"
            )
        if not p["prompt_ids"] and min(len(p["chosen_ids"]), len(p["rejected_ids"])) < 2:
            raise DataError(
                f"preference example {i}: no prompt and a one-token completion: nothing precedes its "
                "token, so it has no target"
            )
        lens = [len(p["prompt_ids"]) + len(p[k]) for k in ("chosen_ids", "rejected_ids")]
        long = max_length is not None and max(lens) > max_length
        if long and truncation == "drop":
            raise DataError(
                f"preference example {i}: prompt + completion has {max(lens)} tokens, over --max_length "
                f"{max_length} (--truncation truncate cuts it as TRL does)"
            )
        cut += long
        for k in ("ref_chosen_logps", "ref_rejected_logps"):
            if k in ex:
                p[k] = float(ex[k])
        rows.append(p)
    if not rows:
        raise DataError(f"preference dataset {name}: no examples")
    return Dataset.from_list(rows), {"pairs": len(rows), "truncated": cut}


# ------------------------------------------------------------------------------------ collate
class PairCollator:
    """Pairs -> rows: [prompt + chosen | prompt + rejected], position ids restarting at the second, right-padded
    (to a multiple of pad_to_multiple_of: context parallelism). labels carry (pair, side, token) on the completion
    targets (encode_targets), unshifted as every hfpar label; ref_logps (P, 2) when the pairs carry them.
    Truncation as `truncate_pair`. Without share_prompt, one pair per row (P = B).

    share_prompt: the prompt is computed once per pair: [prompt + chosen | p + rejected], where p is the prompt's
    last token only (it predicts the first rejected token; its position is the prompt's last), and an attention_mask
    (B, 1, T, T) (built from the batch's compact `pair_layout` where it is used, on its device:
    with_attention_mask) lets the rejected sequence see the chosen row's prompt before p (and not the chosen
    completion): every token sees exactly what it sees in its own sequence, so the log-probs are those of the two
    sequences run
    apart, for ~P fewer tokens a pair (prefix sharing; the embedded set: 17% fewer tokens). The same mask then
    packs pairs: several to a row (first-fit decreasing, no row longer than the batch's longest pair, so no
    attention block grows), each pair seeing only itself, and `pairs` (P,) holds each pair's row (the embedded
    set: 44% fewer positions, the padding gone); pack=False keeps one pair per row (MoE models: see
    hfpar.recipes.dpo.packs_pairs). For attentions that take a custom mask (sdpa, eager) and neither
    context parallelism (its own attention, cut by position ids) nor a pipeline. Where truncation left the two
    prompts different (keep_end), the pair is the plain layout."""

    def __init__(
        self,
        tokenizer,
        *,
        max_length: int | None = None,
        truncation_mode: str = "keep_start",
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        share_prompt: bool = False,
        pack: bool | None = None,
    ):
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.limits = {
            "max_length": max_length,
            "truncation_mode": truncation_mode,
            "max_prompt_length": max_prompt_length,
            "max_completion_length": max_completion_length,
        }
        self.multiple = pad_to_multiple_of
        self.share_prompt = share_prompt
        self.pack = share_prompt if pack is None else pack and share_prompt

    def _shared(self, c: tuple[list, list], r: tuple[list, list]) -> int:
        """Leading prompt tokens the rejected sequence takes from the chosen one's (0: none, the plain layout)."""
        if not self.share_prompt:
            return 0
        n = 0
        for ci, cm, ri, rm in zip(*c, *r):
            if cm or rm or ci != ri:
                break
            n += 1
        return max(n - 1, 0)  # the last common prompt token stays: it predicts the first rejected token

    def _segment(self, b: int, f: dict) -> tuple[list, list, list, int, int]:
        """Pair b's tokens, labels, positions, chosen length and shared prompt tokens."""
        seqs = truncate_pair(f, **self.limits)
        shared = self._shared(seqs["chosen"], seqs["rejected"])
        ids, labels, pos = [], [], []
        for side, key in ((0, "chosen"), (1, "rejected")):
            s_ids, s_mask = seqs[key]
            skip = shared if side else 0
            ids += s_ids[skip:]
            pos += range(skip, len(s_ids))
            # the label of a token is its own id (the trainer shifts): its target when the token is completion
            start = len(labels)
            labels += [
                encode_targets(t, b, side) if m and not f.get("no_targets") else IGNORE
                for t, m in zip(s_ids[skip:], s_mask[skip:])
            ]
            labels[start] = IGNORE  # a sequence's first token is nobody's target (nothing precedes it)
        return ids, labels, pos, len(seqs["chosen"][0]), shared

    @staticmethod
    def _pack(lengths: list[int]) -> list[list[int]]:
        """Pair indices per row: first-fit decreasing into rows of the longest pair's length."""
        cap, rows, room = max(lengths), [], []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
            if r is None:
                rows.append([])
                room.append(cap)
                r = len(rows) - 1
            rows[r].append(i)
            room[r] -= lengths[i]
        return rows

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        segs = [self._segment(b, f) for b, f in enumerate(features)]
        rows = self._pack([len(s[0]) for s in segs]) if self.pack else [[b] for b in range(len(segs))]
        length = max(sum(len(segs[i][0]) for i in r) for r in rows)
        if self.multiple:
            length = -(-length // self.multiple) * self.multiple
        # each key's rows as Python lists, one tensor per key (no per-pair tensor ops: the host's share of a step)
        cols = {k: [] for k in ("input_ids", "labels", "position_ids", "token_mask", "start", "lo", "hi")}
        for r in rows:
            row = {k: [] for k in cols}
            for i in r:
                ids, labels, pos, first, shared = segs[i]
                o, n = len(row["input_ids"]), len(ids)
                row["input_ids"] += ids
                row["labels"] += labels
                row["position_ids"] += pos
                # a token sees the keys [start, lo) and [hi, itself] of its pair: the chosen ones [o, itself], the
                # rejected ones the shared prompt [o, o + shared) and themselves [o + first, itself]
                row["start"] += [o] * n
                row["lo"] += [o] * first + [o + shared] * (n - first)
                row["hi"] += [o] * first + [o + first] * (n - first)
            real = len(row["input_ids"])
            row["token_mask"] = [1] * real
            pad = list(range(real, length))  # padding sees itself only: [t, t] and [t, t)
            for k, fill in (
                ("input_ids", [self.pad_id] * len(pad)),
                ("labels", [IGNORE] * len(pad)),
                ("position_ids", [0] * len(pad)),
                ("token_mask", [0] * len(pad)),
                ("start", pad),
                ("lo", pad),
                ("hi", pad),
            ):
                cols[k].append(row[k] + fill)
        batch = {
            k: torch.tensor(cols[k], dtype=torch.long) for k in ("input_ids", "labels", "position_ids", "token_mask")
        }
        if self.share_prompt:  # the (B, 1, T, T) mask is built where the rows are used (pair_attention_mask)
            layout = torch.tensor([cols["start"], cols["lo"], cols["hi"]], dtype=torch.long)
            batch["pair_layout"] = layout.transpose(0, 1).contiguous()  # (B, 3, T)
            owner = [0] * len(segs)
            for b, r in enumerate(rows):
                for i in r:
                    owner[i] = b
            batch["pairs"] = torch.tensor(owner, dtype=torch.long)  # (P,) each pair's row
        if "ref_chosen_logps" in features[0]:
            batch["ref_logps"] = torch.tensor(
                [[f["ref_chosen_logps"], f["ref_rejected_logps"]] for f in features], dtype=torch.float64
            )  # (P, 2)
        return batch


def pair_attention_mask(layout: torch.Tensor) -> torch.Tensor:
    """The (B, 1, T, T) boolean attention mask of shared-prompt rows from their (B, 3, T) pair_layout (PairCollator:
    start, lo, hi per token), on the layout's device, in a few vectorized ops (O(B T) from the host, not O(B T^2)):
    token t sees the keys [start, lo) and [hi, t]: block-causal, each pair seeing only itself, a rejected token not
    the chosen completion, padding only itself."""
    start, lo, hi = (x.unsqueeze(-1) for x in layout.unbind(1))
    j = torch.arange(layout.shape[-1], device=layout.device)
    return (((j >= start) & (j < lo)) | ((j >= hi) & (j <= j[:, None]))).unsqueeze(1)


def with_attention_mask(batch: dict) -> dict:
    """batch with its pair_layout (if any) replaced by the attention_mask it stands for (in place; idempotent)."""
    layout = batch.pop("pair_layout", None)
    if layout is not None:
        batch["attention_mask"] = pair_attention_mask(layout)
    return batch


# ------------------------------------------------------------------------------------ the recipe's
def load_preference(args, tokenizer) -> tuple[Dataset, dict]:
    """The dpo recipe's tokenized train pairs: --dataset_name (a file, directory or hub id; its train split) or the
    embedded set."""
    if args.dataset_name is None:
        raw = make_preference(args.seed)["train"]
    else:
        splits = _load_raw(args.dataset_name)
        if "train" not in splits:
            raise DataError(f"dataset {args.dataset_name}: no train split (have {', '.join(splits)})")
        raw = splits["train"]
    return tokenize_preference(
        raw,
        tokenizer,
        args.max_length or args.max_seq_length,
        truncation_mode=args.truncation_mode,
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length,
        truncation=args.truncation,
        name=args.dataset_name or "embedded",
    )


def load_preference_eval(args, tokenizer) -> Dataset | None:
    """The dpo recipe's tokenized eval pairs: the embedded set's eval split, or --dataset_name's eval / test /
    validation (valid, dev) split (None without one: the recipe then trains without evaluation)."""
    if args.dataset_name is None:
        raw = make_preference(args.seed)["eval"]
    else:
        splits = _load_raw(args.dataset_name)
        name = next((k for k in ("eval", "validation", "valid", "dev", "test") if k in splits), None)
        if name is None:
            return None
        raw = splits[name]
    ds, _ = tokenize_preference(
        raw,
        tokenizer,
        args.max_length or args.max_seq_length,
        truncation_mode=args.truncation_mode,
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length,
        truncation=args.truncation,
        name=f"{args.dataset_name or 'embedded'} (eval)",
    )
    return ds


def pair_collator(
    args, tokenizer, seq_multiple: int = 1, share_prompt: bool = False, pack: bool | None = None
) -> PairCollator:
    return PairCollator(
        tokenizer,
        max_length=args.max_length or args.max_seq_length,
        truncation_mode=args.truncation_mode,
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length,
        pad_to_multiple_of=seq_multiple if seq_multiple > 1 else None,
        share_prompt=share_prompt,
        pack=pack,
    )
