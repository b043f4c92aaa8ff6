"""Training rows of online RL: prompt + completion, one row each, right-padded, the completion tokens as targets.

    collate = RolloutCollator(pad_id=0, seq_multiple=ctx.seq_multiple)
    batch = collate([{"prompt_ids": [...], "completion_ids": [...], "targets": [1, 1, 0], "advantage": 0.5,
                      "old_logps": [...] | None, "ref_logps": [...] | None}, ...])

The batch: input_ids / attention_mask (B, T), labels (B, T) with each completion target carrying its row
(hfpar.data.preference.encode_targets(token, row, 0): the objective finds a token's row in any cut of the batch),
`advantages` (B,), and per-token values in the predicting position's column (the value of the completion token at
column c sits at c - 1, where the causal-LM shift puts its target), so that context parallelism's cut of every (B, T)
tensor keeps them with their targets: `old_logps`, `ref_logps` (where the samples have them) and `columns` (each
position's column in the full row, to put values computed on a cut back in place). A completion token whose
`targets` entry is 0 (after EOS, or a truncated completion with --mask_truncated_completions) is no target.
Right padding needs no attention mask under a causal model (padding only follows the real tokens): the mask is kept
for the attention kernels that use it.
"""

from __future__ import annotations

import torch

from hfpar.data.preference import encode_targets
from hfpar.parallel.labels import IGNORE

SIDE = ("old_logps", "ref_logps")


class RolloutCollator:
    def __init__(self, pad_id: int, seq_multiple: int = 1):
        self.pad_id, self.seq_multiple = pad_id, max(1, seq_multiple)

    def __call__(self, samples: list[dict]) -> dict:
        lengths = [len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples]
        t = -(-max(lengths) // self.seq_multiple) * self.seq_multiple
        b = len(samples)
        ids = torch.full((b, t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.long)
        labels = torch.full((b, t), IGNORE, dtype=torch.long)
        side = {k: torch.zeros((b, t), dtype=torch.float32) for k in SIDE if samples[0].get(k) is not None}
        for r, s in enumerate(samples):
            p, c = len(s["prompt_ids"]), len(s["completion_ids"])
            comp = torch.tensor(s["completion_ids"], dtype=torch.long)
            ids[r, : p + c] = torch.tensor(list(s["prompt_ids"]) + list(s["completion_ids"]), dtype=torch.long)
            mask[r, : p + c] = 1
            keep = torch.tensor(s["targets"], dtype=torch.bool)
            labels[r, p : p + c] = torch.where(keep, encode_targets(comp, r, 0), IGNORE)
            for k, v in side.items():
                v[r, p - 1 : p + c - 1] = torch.tensor(s[k], dtype=torch.float32)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, **side}
        batch["advantages"] = torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float32)
        batch["columns"] = torch.arange(t).expand(b, t).clone()
        return batch
