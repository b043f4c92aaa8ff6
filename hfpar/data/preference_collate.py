"""Tokenized pairs into batches: one row per pair (or pairs sharing their prompt), and the rows' attention masks.

    batch = PairCollator(tok)([train[i] for i in range(8)])      # input_ids, labels, position_ids, token_mask
    with_attention_mask(batch)                                   # share_prompt: pair_layout -> its (B, 1, T, T) mask

The row layout: hfpar/data/preference.py's docstring.
"""

from __future__ import annotations

import torch

from hfpar.parallel.labels import IGNORE

from .preference_tokenize import encode_targets, truncate_pair


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

    def segment(self, b: int, f: dict) -> tuple[list, list, list, int, int]:
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
    def pack_rows(lengths: list[int]) -> list[list[int]]:
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
        segs = [self.segment(b, f) for b, f in enumerate(features)]
        rows = self.pack_rows([len(s[0]) for s in segs]) if self.pack else [[b] for b in range(len(segs))]
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
