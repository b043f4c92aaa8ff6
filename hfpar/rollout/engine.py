"""Where completions come from: the interface a rollout engine implements, and the engine hfpar has, the policy
generating in its own parallel layout.

    engine = InPlaceEngine(GenerationConfig(max_new_tokens=16, temperature=1.0, eos_token_id=[2], pad_token_id=0))
    completions = engine.generate(backend, prompt_ids, keys)    # collective; list of token-id lists, EOS kept

InPlaceEngine calls transformers' `generate` (its KV cache, EOS stopping) on the model as the backend holds it:
TP shards, EP experts, FSDP2 / ZeRO-3 parameters gathered layer by layer by their own forward hooks, in the
backend's autocast. Every rank runs the same number of forwards per decoding step (transformers' `synced_gpus`)
when there is more than one process, since those forwards are collective. Context-parallel ranks of a replica
generate the same rows (generation needs no cut of the sequence). Sampling is hfpar.rollout.sampling's: each row's
tokens depend on its key, never on the batch. The settings are TRL GRPOTrainer's (hfpar.rollout.sampling): its own
generation config, completed by the checkpoint's generation_config (`checkpoint_generation_config`, read from the
model's directory, so the same under hfpar's sharded loading), and every EOS id the checkpoint declares plus the
tokenizer's stops a completion, cuts it and marks it terminated (`eos_token_ids`, `truncated`).

ReplicaEngine is the colocated kind (TRL's vLLM colocate mode, transformers' generate in place of vLLM): a pipeline
has no whole model on a rank, so each rank generates with a whole replica of the policy, its weights synced from
the pipeline's stages before every generation (backend.full_state_dict, broadcast over the pipeline group). It holds
a whole model per rank while it generates: the price of pipelining a model that otherwise would not fit (docs/grpo.md).
An engine of another kind (vLLM) implements the same `generate(backend, prompt_ids, keys) -> completions`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM
from transformers import GenerationConfig as HFGenerationConfig

from hfpar.distributed import unwrap
from hfpar.parallel.context_parallel import whole_sequence
from hfpar.rollout.sampling import eos_list, sample


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_new_tokens: int = 0  # no EOS before this many new tokens (transformers' min_new_tokens)
    eos_token_id: int | list[int] | None = None  # every id ends a completion (eos_token_ids: TRL's list)
    pad_token_id: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0  # TRL's default: a checkpoint's own (e.g. 1.05) does not apply
    bos_token_id: int | None = None
    checkpoint: HFGenerationConfig | None = None  # its generation_config: what TRL's settings leave unset

    @property
    def eos_ids(self) -> list[int]:
        return eos_list(self.eos_token_id)


def checkpoint_generation_config(source: str | None, model) -> HFGenerationConfig | None:
    """The generation_config the checkpoint ships (generation_config.json of `source`, a directory or hub id), as
    from_pretrained gives a model; without one, the one transformers derives from the model's config. Read from the
    files, not the model object: hfpar's sharded loading builds the model from its config alone."""
    if source:
        try:
            return HFGenerationConfig.from_pretrained(source)
        except (OSError, ValueError):
            pass  # no generation_config.json: transformers derives one from config.json, as below
    config = getattr(model, "config", None)
    return HFGenerationConfig.from_model_config(config) if config is not None else None


def eos_token_ids(checkpoint: HFGenerationConfig | None, tokenizer_eos: int | None) -> list[int]:
    """TRL GRPOTrainer's EOS list: every id of the checkpoint's generation_config, the tokenizer's first if missing."""
    ids = eos_list(checkpoint.eos_token_id if checkpoint is not None else None)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids = [tokenizer_eos, *ids]
    return ids


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, prompts right-aligned (generation continues at the right edge)."""
    p = max(len(x) for x in prompt_ids)
    ids = torch.full((len(prompt_ids), p), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), p), dtype=torch.long)
    for r, x in enumerate(prompt_ids):
        if x:
            ids[r, p - len(x) :] = torch.tensor(x, dtype=torch.long)
            mask[r, p - len(x) :] = 1
    return ids, mask


def cut_at_eos(row: list[int], eos_token_id: int | list[int] | None) -> tuple[list[int], bool]:
    """(the completion up to and including its first EOS (an id, or any of a list), whether it ended with one)."""
    eos = set(eos_list(eos_token_id))
    for end, t in enumerate(row):
        if t in eos:
            return row[: end + 1], True
    return row, False


def truncated(row: list[int], eos_ids: list[int], pad_token_id: int | None) -> bool:
    """TRL's rule (GRPOTrainer, mask_truncated_completions and completions/clipped_ratio): a completion is
    truncated when its last token is neither an EOS id nor the pad token."""
    return not row or row[-1] not in (*eos_ids, pad_token_id)


class InPlaceEngine:
    def __init__(self, config: GenerationConfig):
        self.config = config
        self._root_ran = False

    def generate(self, backend, prompt_ids: list[list[int]], keys: list[int]) -> list[list[int]]:
        """Collective: every rank calls it with its rows (the same number of calls on every rank)."""
        ids, mask = left_pad(prompt_ids, self.config.pad_token_id)
        synced = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        return self._run(unwrap(backend.model), backend, ids, mask, keys, synced)

    def _run(self, model, backend, ids, mask, keys, synced: bool) -> list[list[int]]:
        cfg = self.config
        device = backend.acc.device
        was_training = model.training
        model.eval()
        # FSDP2: the root unit's own parameters (embeddings, final norm, head) gathered for the whole generation, as
        # generate may call an inner module (PEFT's base model) and so bypass the root's pre-forward gather
        root = model if isinstance(model, FSDPModule) else None
        try:
            if root is not None:
                if not self._root_ran:  # FSDP2 initializes on the root's first forward, which must come first
                    # (a whole-sequence forward: under CP the attention is the model's own here, as in generation)
                    with torch.no_grad(), whole_sequence(model):
                        model(input_ids=ids[:, :1].to(device), use_cache=False)
                    self._root_ran = True
                root.unshard()
            with backend.autocast(), torch.no_grad(), whole_sequence(model):
                out = sample(
                    model,
                    ids.to(device),
                    mask.to(device),
                    keys,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    min_new_tokens=cfg.min_new_tokens,
                    eos_token_id=cfg.eos_ids or None,
                    pad_token_id=cfg.pad_token_id,
                    synced_gpus=synced,
                    min_p=cfg.min_p,
                    repetition_penalty=cfg.repetition_penalty,
                    bos_token_id=cfg.bos_token_id,
                    # the checkpoint's, also where the model object lacks it (built from its config)
                    base_config=cfg.checkpoint,
                )
        finally:
            model.train(was_training)
            if root is not None:
                root.reshard()
        new = out[:, ids.shape[1] :].cpu().tolist()
        return [cut_at_eos(row, cfg.eos_ids)[0] for row in new]


class ReplicaEngine(InPlaceEngine):
    def __init__(self, config: GenerationConfig, ctx):
        super().__init__(config)
        self.ctx, self.replica = ctx, None

    def _synced(self, backend) -> torch.nn.Module:
        """The whole policy as the stages hold it now (collective over the pipeline group)."""
        full = backend.full_state_dict()  # merged on the pipeline's first rank
        box = [full if self.ctx.rank == self.ctx.pp_peers[0] else None]
        torch.distributed.broadcast_object_list(box, src=self.ctx.pp_peers[0], group=self.ctx.pp_group)
        if self.replica is None:
            stage = backend.unwrapped()
            config = copy.deepcopy(getattr(stage, "full_config", None) or stage.config)  # the whole model's
            # with the attention context parallelism replaced, if it did
            config._attn_implementation = getattr(stage, "_hfpar_attn_before_cp", config._attn_implementation)
            self.replica = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(backend.acc.device)
        missing, unexpected = self.replica.load_state_dict(box[0], strict=False)
        tied = {k for k in missing if self.replica.config.tie_word_embeddings and "lm_head" in k}
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"generation replica: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
        if tied:
            self.replica.tie_weights()
        return self.replica

    def generate(self, backend, prompt_ids: list[list[int]], keys: list[int]) -> list[list[int]]:
        """Collective over the pipeline group (the weights' sync); the generation itself is this rank's own."""
        model = self._synced(backend)
        ids, mask = left_pad(prompt_ids, self.config.pad_token_id)
        return self._run(model, backend, ids, mask, keys, synced=False)
