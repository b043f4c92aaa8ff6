"""A sequence-classification model directory as a reward function (TRL's reward-model path): its first logit on
prompt + completion is the reward.

    rm = RewardModel(Path("outputs/reward"), device)     # safetensors weights, no code from the directory
    values = rm(prompts, completions)                    # list[float], one per completion

Conversational rows are rendered with the reward model's own chat template (messages + the assistant's completion),
standard rows as prompt + completion text, as TRL's GRPOTrainer does; padded on the right, the model's own
pad token, no gradient.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


class RewardModel:
    def __init__(self, path: Path, device: torch.device, batch_size: int = 32):
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, trust_remote_code=False, use_safetensors=True, dtype=torch.float32
        ).to(device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id
        self.device, self.batch_size = device, batch_size

    def _texts(self, prompts: list, completions: list) -> list[str]:
        out = []
        for p, c in zip(prompts, completions):
            if isinstance(p, list):  # conversational: the messages and the assistant's reply
                out.append(self.tokenizer.apply_chat_template(p + c, tokenize=False))
            else:
                out.append(p + c)
        return out

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list) -> list[float]:
        texts = self._texts(prompts, completions)
        pad = self.model.config.pad_token_id
        values: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[i : i + self.batch_size]]
            n = max(len(e) for e in enc)
            ids = torch.full((len(enc), n), pad, dtype=torch.long)
            mask = torch.zeros((len(enc), n), dtype=torch.long)
            for r, e in enumerate(enc):
                ids[r, : len(e)] = torch.tensor(e, dtype=torch.long)
                mask[r, : len(e)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            values += logits[:, 0].float().cpu().tolist()
        return values
