"""Does this model keep packed samples apart? Decided by what the model does, not by its name.

    why_not = packing_problem(config, "sdpa")     # None: padding-free rows train each sample as if alone

Padding-free rows hold several samples, told apart only by their position ids (each sample's restart at 0).
transformers 5 builds the block-diagonal causal mask from them (masking_utils.find_packed_sequence_indices) for eager,
sdpa and flex attention, and varlen kernels use them for flash attention; a family whose mask ignores them (OPT,
BLOOM), whose layers carry state along the row (Mamba, linear attention, short convolutions) or that attends both
ways (encoders) would let one sample see another.

The probe: a tiny copy of the model (hfpar.parallel.tiny_copy.tiny_model of the run's own config: the same family, its
first 8 layers with their kinds, windows and settings, the widths shrunk, float64, CPU, random weights) runs one
padding-free batch of six samples in three rows (the collator's own layout), each sample alone, and the batch again
with one sample changed:
- each sample's logits in the rows equal its logits alone (its positions restart, nothing else reaches it);
- no other sample's logits move when one sample changes (nothing crosses between samples).
Both to 1e-6 relative: a leak measures 1e-3 and more (Falcon-H1's Mamba layers 2e-3, BERT as a decoder 1e-2;
benchmarks/results/baselines/packing_families.json);
families that keep samples apart measure 0 to 1e-7 (an fp32 router or softmax inside a float64 model). Custom code
(a config's auto_map) is not run: such a model keeps padded rows. The answer is cached per config and attention.
"""

from __future__ import annotations

import torch

from ..parallel.tiny_copy import CPU_ATTENTIONS, check_once
from .collate import DataCollator, first_fit_decreasing

LENS, CAP = (9, 14, 5, 12, 7, 3), 20  # six samples, three rows of <= 20 tokens (first-fit decreasing)
TOL = 1e-6


def packing_problem(config, attn: str | None = None) -> str | None:
    """None where packed rows keep `config`'s causal LM's samples apart, else why not (one line). attn: the run's
    --attn_implementation (None: transformers' default for the model)."""
    return check_once("packing", config, _check, attn if attn in CPU_ATTENTIONS else None)


def _check(model) -> str | None:
    alone, moved = _leaks(model)
    if moved > TOL:
        return f"its packed samples see each other (a sample's logits move by {moved:.1e} when another one changes)"
    if alone > TOL:
        return f"a packed sample's logits differ from the sample run alone by {alone:.1e} (positions not restarted)"
    return None


def _rows_logits(model, samples: list[list[int]]) -> list[torch.Tensor]:
    """Each sample's logits, read from ONE padding-free batch of all of them, laid out as the collator lays them."""
    batch = DataCollator(pad_token_id=0, padding_free=True, max_seq_length=CAP)([{"input_ids": s} for s in samples])
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    out = [None] * len(samples)
    for r, row in enumerate(first_fit_decreasing(list(LENS), CAP)):
        t = 0
        for i in row:
            out[i] = logits[r, t : t + LENS[i]]
            t += LENS[i]
    return out


def _leaks(model) -> tuple[float, float]:
    """(largest relative difference, packed vs alone; largest relative move of the other samples when one changes)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(1, min(vocab, 64), (n,), generator=g).tolist() for n in LENS]
    with torch.no_grad():
        rows = _rows_logits(model, samples)
        alone = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]
        changed = [*samples[:1], [(t * 7 + 3) % (min(vocab, 64) - 1) + 1 for t in samples[1]], *samples[2:]]
        after = _rows_logits(model, changed)
    scale = max(float(a.abs().max()) for a in alone) or 1.0
    diff = max(float((r - a).abs().max()) for r, a in zip(rows, alone)) / scale
    moved = max(float((x - y).abs().max()) for i, (x, y) in enumerate(zip(after, rows)) if i != 1) / scale
    return diff, moved
