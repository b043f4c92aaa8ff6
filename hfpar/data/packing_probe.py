"""Does this model keep packed samples apart? Decided by what the model does, not by its name.

    why_not = packing_problem(config, "sdpa")     # None: padding-free rows train each sample as if alone

Padding-free rows hold several samples, told apart only by their position ids (each sample's restart at 0).
transformers 5 builds the block-diagonal causal mask from them (masking_utils.find_packed_sequence_indices) for eager,
sdpa and flex attention, and varlen kernels use them for flash attention; a family whose mask ignores them (OPT,
BLOOM), whose layers carry state along the row (Mamba, linear attention, short convolutions) or that attends both
ways (encoders) would let one sample see another.

The probe: a tiny copy of the model (hfpar.loading.tiny_config.shrink of the run's own config: the same family, its
first LAYERS layers with their kinds, windows and settings, the widths shrunk, float64, CPU, random weights) runs one
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

import contextlib
import copy

import torch

from ..loading.tiny_config import shrink
from .collate import DataCollator, first_fit_decreasing

LENS, CAP = (9, 14, 5, 12, 7, 3), 20  # six samples, three rows of <= 20 tokens (first-fit decreasing)
TOL = 1e-6
LAYERS = 8  # the tiny copy's depth (at most the model's): its first 8 layers, which hold every kind of the usual
# hybrid patterns (3 linear-attention or chunked layers to 1 full, 5 sliding to 1 global)
MAX_PARAMS = 20_000_000  # a size field no shrink rule knows: not probed (no memory blow-up before training)
# size fields a config holds explicitly once derived (Falcon's num_kv_heads from its 71 heads) and those of
# state-space layers (Mamba-2 heads, states, chunks), shrunk so a tiny hybrid runs in milliseconds
PROBE_SHRINK = {
    "num_kv_heads": 4,  # as many as the tiny heads (TINY): valid whether the family shares them or not
    "mamba_d_ssm": 32,
    "mamba_n_heads": 4,
    "mamba_d_head": 8,
    "mamba_d_state": 8,
    "mamba_chunk_size": 8,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "ssm_state_size": 8,
    "state_size": 8,
    "chunk_size": 8,
    "time_step_rank": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 1,
}
# the attention the tiny copy runs: the run's where it runs on CPU in float64, else transformers' default for the
# model (sdpa where the family has it: the same packed mask; flash kernels take the same position ids)
CPU_ATTENTIONS = ("eager", "sdpa", "hfpar_varlen")


def packing_problem(config, attn: str | None = None) -> str | None:
    """None where packed rows keep `config`'s causal LM's samples apart, else why not (one line). attn: the run's
    --attn_implementation (None: transformers' default for the model)."""
    if not hasattr(config, "to_json_string"):
        return f"no model config to check (got {type(config).__name__})"
    if getattr(config, "auto_map", None):
        return "its model is custom code (the config's auto_map), which the packing check does not run"
    attn = attn if attn in CPU_ATTENTIONS else None
    key = (type(config).__name__, config.to_json_string(use_diff=False), attn)
    if key not in _ANSWERS:
        _ANSWERS[key] = _probe(copy.deepcopy(config), attn)
    return _ANSWERS[key]


_ANSWERS: dict[tuple, str | None] = {}


def _probe(config, attn: str | None) -> str | None:
    try:
        model = _tiny_model(config, attn)
        if isinstance(model, str):
            return model
        alone, moved = _leaks(model)
    except Exception as e:  # noqa: BLE001 - whatever the family raises: it cannot be checked, so rows stay padded
        first = str(e).splitlines()[0][:160] if str(e) else ""
        return f"its tiny copy could not be checked ({type(e).__name__}: {first})"
    if moved > TOL:
        return f"its packed samples see each other (a sample's logits move by {moved:.1e} when another one changes)"
    if alone > TOL:
        return f"a packed sample's logits differ from the sample run alone by {alone:.1e} (positions not restarted)"
    return None


@contextlib.contextmanager
def _quiet_seeded():
    """transformers' config and init warnings silenced (the tiny sizes trip them), the global RNG left as it was."""
    # transformers imported on use: why: docs/architecture.md#why-start-up-time
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            yield
    finally:
        hf_logging.set_verbosity(level)


def _tiny_model(config, attn: str):
    """The tiny float64 copy, or why it is not probed."""
    # transformers imported on use: why: docs/architecture.md#why-start-up-time
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.modeling_utils import set_zero3_state  # noqa: PLC0415

    with _quiet_seeded(), set_zero3_state():
        tiny = shrink(config, LAYERS, extra=PROBE_SHRINK)
        with torch.device("meta"):
            n = sum(p.numel() for p in _build(AutoModelForCausalLM, tiny, attn).parameters())
        if n > MAX_PARAMS:
            return f"its tiny copy still has {n / 1e6:.0f}M parameters (a size field the checker does not shrink)"
        with torch.device("cpu"):
            model = _build(AutoModelForCausalLM, tiny, attn)
    return model.double().eval()


def _build(auto, tiny, attn: str | None):
    """MoE families with the per-expert loop (grouped_mm has no float64); transformers' default attention where
    none is asked and the family has no sdpa (eager, as its from_pretrained falls back to)."""
    for kw in (
        {"attn_implementation": attn or "sdpa", "experts_implementation": "eager"},
        {"attn_implementation": attn or "sdpa"},
    ):
        with contextlib.suppress(TypeError, ValueError):
            return auto.from_config(tiny, **kw)
    return auto.from_config(tiny, attn_implementation=attn or "eager")


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
