"""Sampling whose tokens are a function of (seed, step, prompt, generation index) and the weights, never of the mesh:
each completion row draws its noise from a generator of its own, so how rows are batched, padded or split over ranks
does not change what a row samples. Built on transformers' `generate` (its KV cache, EOS stopping, left padding).

    keys = [row_key(seed, step, prompt_index, g) for ...]                      # one per completion row
    out = sample(model, prompt_ids, prompt_mask, keys, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=0,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)   # (B, prompt + new) ids

How: Gumbel-max. With the row's logits processed and warped as transformers' sampling does, adding independent Gumbel
noise -log(-log U) and taking the argmax draws from softmax(warped logits); `generate` runs greedy (do_sample=False)
over the noised logits. A torch.Generator per row (seeded from its key) gives U, one vocabulary-sized draw per decoding
step, so a row's draws depend on its key and its position only.

The distribution is TRL GRPOTrainer's: its own GenerationConfig (max_new_tokens, do_sample, pad / bos / eos ids,
temperature, top_p, top_k, min_p, repetition_penalty 1.0 unless asked, generation_kwargs), completed where it leaves a
value unset by the checkpoint's generation_config (`base`), as generate merges a model's; so a setting the checkpoint
ships and TRL overrides (Qwen2.5-Instruct's repetition_penalty 1.05) does not apply. generate applies the processors
(repetition penalty, min_new_tokens, ...); the warpers do_sample would apply after them (temperature, top-k, top-p,
min-p, typical, epsilon, eta: `warpers_of`) run here, in transformers' order, before the noise.
"""

from __future__ import annotations

import copy
import hashlib

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# the GenerationConfig fields of transformers' sampling warpers (do_sample's), run by hfpar before its noise
WARPER_FIELDS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def eos_list(eos_token_id) -> list[int]:
    """An EOS id, a list of them, or None, as a list (generate takes either; TRL's GRPOTrainer holds a list)."""
    return [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


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
    return warpers_of(GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p), None)


def warpers_of(cfg: GenerationConfig, device) -> list[LogitsProcessor]:
    """The warpers transformers' generate builds from `cfg` when it samples (GenerationMixin._get_logits_processor's
    do_sample branch, one beam: min_tokens_to_keep 1), in its order."""
    out: list[LogitsProcessor] = []
    if cfg.temperature is not None and cfg.temperature != 1.0:
        out.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_h is not None:
        out.append(TopHLogitsWarper(top_h=cfg.top_h))
    if cfg.top_k is not None and cfg.top_k != 0:
        out.append(TopKLogitsWarper(top_k=cfg.top_k))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=cfg.top_p))
    if cfg.min_p is not None:
        out.append(MinPLogitsWarper(min_p=cfg.min_p))
    if cfg.typical_p is not None and cfg.typical_p < 1.0:
        out.append(TypicalLogitsWarper(mass=cfg.typical_p))
    if cfg.epsilon_cutoff is not None and 0.0 < cfg.epsilon_cutoff < 1.0:
        out.append(EpsilonLogitsWarper(epsilon=cfg.epsilon_cutoff))
    if cfg.eta_cutoff is not None and 0.0 < cfg.eta_cutoff < 1.0:
        out.append(EtaLogitsWarper(epsilon=cfg.eta_cutoff, device=device))
    return out


def trl_generation_config(base: GenerationConfig | None, **settings) -> GenerationConfig:
    """TRL GRPOTrainer's GenerationConfig of `settings` (do_sample, disable_compile), completed by `base` where a
    value is unset, as generate completes a passed config with the model's generation_config."""
    cfg = GenerationConfig(do_sample=True, disable_compile=True, **settings)
    if base is not None:
        cfg.update(**base.to_dict(), defaults_only=True, allow_custom_entries=True)
    return cfg


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
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    bos_token_id: int | None = None,
    base_config: GenerationConfig | None = None,
    **generate_kwargs,
) -> torch.Tensor:
    """prompt_ids / prompt_mask: (B, P) left-padded; keys: one row_key per row. -> (B, P + new) token ids, rows that
    stopped at EOS padded with pad_token_id after it. min_new_tokens: EOS masked before that many new tokens
    (transformers' processor, before the warpers and the noise: a row's draws stay its own). synced_gpus: every rank
    runs a forward per decoding step until all are done (transformers' own flag; needed where the forward is
    collective: sharded or model-parallel layers). eos_token_id: an id or a list (every one stops a row).
    base_config: the checkpoint's generation_config (default: the model's), completing TRL's settings (module
    docstring). generate_kwargs: more of generate's own (output_logits=True, return_dict_in_generate=True: its output
    object, with each step's raw logits: benchmarks/grpo/generation_sweep.py)."""
    if len(keys) != prompt_ids.size(0):
        raise ValueError(f"sample: {len(keys)} row keys for {prompt_ids.size(0)} rows")
    settings = dict(
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    if min_new_tokens:  # TRL's generation_kwargs
        settings["min_new_tokens"] = min_new_tokens
    full = trl_generation_config(base_config or getattr(model, "generation_config", None), **settings)
    processors = LogitsProcessorList([*warpers_of(full, prompt_ids.device), RowGumbelNoise(keys, prompt_ids.device)])
    greedy = copy.deepcopy(full)  # the rest of TRL's config, greedy over the noised scores
    greedy.update(do_sample=False, num_beams=1, use_cache=True, **dict.fromkeys(WARPER_FIELDS))
    model_kwargs = greedy.update(**generate_kwargs)  # generate's own output options; the rest go to the model
    return model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=greedy,
        logits_processor=processors,
        synced_gpus=synced_gpus,
        **model_kwargs,
    )


def completion_mask(completion_ids: torch.Tensor, eos_token_id) -> torch.Tensor:
    """(B, C) -> (B, C) 1 up to and including each row's first EOS (an id or a list of ids), 0 after (TRL's
    completion_mask); a row with no EOS (truncated at max_new_tokens) keeps every token."""
    eos = torch.tensor(eos_list(eos_token_id), dtype=torch.long, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)
    first = torch.where(
        is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], completion_ids.size(1), dtype=torch.long)
    )
    return (torch.arange(completion_ids.size(1), device=completion_ids.device)[None] <= first[:, None]).long()
