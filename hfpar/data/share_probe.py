"""Does this model take a pair's shared prompt once? Decided by what the model does, not by its name.

    why_not = prompt_sharing_problem(config, "sdpa")   # None: shared-prompt rows give each sequence's own log-probs

DPO's shared-prompt rows (hfpar.data.preference_collate.PairCollator share_prompt) hold `prompt + chosen | p +
rejected` and pack several pairs to a row, told apart by a (B, 1, T, T) boolean attention mask and restarting
position ids. That trains the plain pairs only where the model's attention takes the mask as given: transformers 5
returns a 4-D mask unchanged for eager, sdpa and flex attention, but a family may add it as a float (eager: True
adds 1), lay its own kind of layer over it (sliding windows, chunked attention, state carried along the row:
Mamba, linear attention, convolutions) or build its mask another way.

The probe: the tiny copy of the run's config (hfpar.parallel.tiny_copy: the same family, its first 8 layers with
their kinds, windows and settings, float64, random weights) runs one batch of four pairs (unequal prompts and
completions, packed by the collator's own layout) and each of the eight sequences alone; every sequence's logits in
the rows must equal its logits alone to 1e-6 (relative). A leak or a mask read another way measures 1e-3 and more;
families that take the mask measure 0 to 1e-7. Cached per config and attention (hfpar.parallel.tiny_copy.check_once,
which also refuses custom code).
"""

from __future__ import annotations

import torch

from ..parallel.tiny_copy import CPU_ATTENTIONS, check_once
from .preference_collate import PairCollator, with_attention_mask

# four pairs: (prompt, chosen, rejected) lengths, unequal: the collator packs two of them into one row; the longest
# (27 positions) spans the tiny copy's windows and chunks (4 tokens), so they act
PAIRS = ((10, 8, 8), (4, 3, 2), (3, 2, 5), (5, 4, 1))
KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
TOL = 1e-6


class _Pad:
    pad_token_id = 0


def prompt_sharing_problem(config, attn: str | None = None) -> str | None:
    """None where shared-prompt pair rows give `config`'s causal LM each sequence's logits as if run alone, else why
    not (one line). attn: the run's --attn_implementation (None: transformers' default for the model); an attention
    the probe cannot run on CPU (flash kernels) does not share."""
    if attn is not None and attn not in CPU_ATTENTIONS:
        return f"--attn_implementation {attn} is not checked on CPU (shared prompts need a mask taken as given)"
    return check_once("share_prompt", config, _check, attn)


def _check(model) -> str | None:
    diff = _difference(model)
    if diff > TOL:
        return f"a sequence's logits in a shared-prompt row differ from the sequence alone by {diff:.1e}"
    return None


def _pairs(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    top = min(vocab, 64)
    return [{k: torch.randint(1, top, (n,), generator=g).tolist() for k, n in zip(KEYS, p)} for p in PAIRS]


def _difference(model) -> float:
    """Largest relative difference of any sequence's logits between the shared-prompt rows and the sequence alone."""
    pairs = _pairs(model.get_input_embeddings().weight.shape[0])
    collator = PairCollator(_Pad(), share_prompt=True, pack=True)
    batch = with_attention_mask(collator(pairs))
    segs = [collator.segment(b, f) for b, f in enumerate(pairs)]  # (ids, labels, positions, chosen len, shared)
    where = {}  # pair -> (row, first column): the collator's own packing of the same lengths
    for r, members in enumerate(PairCollator.pack_rows([len(s[0]) for s in segs])):
        o = 0
        for i in members:
            where[i] = (r, o)
            o += len(segs[i][0])
    worst, scale = 0.0, 0.0
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
            use_cache=False,
        ).logits
        for i, p in enumerate(pairs):
            (row, o), (_, _, _, first, shared) = where[i], segs[i]
            for seq, at, skip in (
                (p["prompt_ids"] + p["chosen_ids"], o, 0),
                (p["prompt_ids"] + p["rejected_ids"], o + first, shared),
            ):
                alone = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, skip:]
                got = logits[row, at : at + len(seq) - skip]
                scale = max(scale, float(alone.abs().max()))
                worst = max(worst, float((got - alone).abs().max()))
    return worst / (scale or 1.0)
