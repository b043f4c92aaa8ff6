"""Sampling whose tokens are a function of (seed, step, prompt, generation index) and the weights, never of the mesh:
each completion row draws its noise from a generator of its own, so how rows are batched, padded or split over ranks
does not change what a row samples. Built on transformers' `generate` (its KV cache, EOS stopping, left padding).

    keys = [row_key(seed, step, prompt_index, g) for ...]                      # one per completion row
    out = sample(model, prompt_ids, prompt_mask, keys, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=0,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)   # (B, prompt + new) ids

How: Gumbel-max. With the row's logits warped as transformers' sampling does (temperature, top-k, top-p), adding
independent Gumbel noise -log(-log U) and taking the argmax draws from softmax(warped logits); `generate` runs greedy
(do_sample=False) over the noised logits. A torch.Generator per row (seeded from its key) gives U, one vocabulary-sized
draw per decoding step, so a row's draws depend on its key and its position only.
"""

from __future__ import annotations

import hashlib

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def row_key(seed: int, step: int, prompt_index: int, generation: int) -> int:
    """A 63-bit seed for one completion row, stable across processes and Python runs (not Python's salted hash)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt_index}/{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class RowGumbelNoise(LogitsProcessor):
    """Adds Gumbel noise from each row's own generator to its (already warped) logits."""

    def __init__(self, keys: list[int], device: torch.device):
        self.gens = [torch.Generator(device=device).manual_seed(k) for k in keys]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.size(-1)
        u = torch.stack(
            [torch.rand(vocab, generator=g, device=scores.device, dtype=torch.float32) for g in self.gens]
        )  # (B, V)
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-20, max=1 - 1e-7)))
        return scores.float() + gumbel


def warpers(temperature: float, top_k: int, top_p: float) -> list[LogitsProcessor]:
    """transformers' own sampling warpers, in its order (temperature, top-k, top-p); 0 / 1.0 disable top-k / top-p."""
    out: list[LogitsProcessor] = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


@torch.no_grad()
def sample(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    keys: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_new_tokens: int = 0,
    eos_token_id=None,
    pad_token_id=None,
    synced_gpus: bool = False,
    **generate_kwargs,
) -> torch.Tensor:
    """prompt_ids / prompt_mask: (B, P) left-padded; keys: one row_key per row. -> (B, P + new) token ids, rows that
    stopped at EOS padded with pad_token_id after it. min_new_tokens: EOS masked before that many new tokens
    (transformers' processor, before the warpers and the noise: a row's draws stay its own). synced_gpus: every rank
    runs a forward per decoding step until all are done (transformers' own flag; needed where the forward is
    collective: sharded or model-parallel layers). generate_kwargs: more of generate's own (output_logits=True,
    return_dict_in_generate=True: its output object, with each step's raw logits: benchmarks/grpo/
    generation_sweep.py)."""
    if len(keys) != prompt_ids.size(0):
        raise ValueError(f"sample: {len(keys)} row keys for {prompt_ids.size(0)} rows")
    processors = LogitsProcessorList([*warpers(temperature, top_k, top_p), RowGumbelNoise(keys, prompt_ids.device)])
    return model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        logits_processor=processors,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens or None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        use_cache=True,
        synced_gpus=synced_gpus,
        **generate_kwargs,
    )


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, C) -> (B, C) 1 up to and including each row's first EOS, 0 after (TRL's completion_mask); a row with no
    EOS (truncated at max_new_tokens) keeps every token."""
    is_eos = completion_ids == eos_token_id
    first = torch.where(
        is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], completion_ids.size(1), dtype=torch.long)
    )
    return (torch.arange(completion_ids.size(1), device=completion_ids.device)[None] <= first[:, None]).long()
