"""VocabParallelEmbedding: W (V/tp, H), each rank looks up its vocab rows, then the sum over ranks.

    emb = VocabParallelEmbedding.from_embedding(nn.Embedding(128, 16), group)    # W (128/tp, 16)
    h = emb(ids)                                                                 # (B, T, H), all-reduced

Under sequence_parallel=True the output is reduce-scattered along T instead: (B, T/tp, H).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import (
    group_rank,
    group_size,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from ..sharding import gather_shards, shard_tensor
from .params import _check_divisible, _is_meta, _mark, _param


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with rows split over the group: rank r holds ids [r*V/tp, (r+1)*V/tp).

    Input ids (B, T) (full vocab ids, same on every rank). Output (B, T, H), or (B, T/tp, H) with
    sequence_parallel. Ids outside [0, V) are not checked (they embed to zeros).
    The row split matches ColumnParallelLinear's, so a tied lm_head can share `weight`.
    """

    weight_shard_dim = 0

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        group=None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device=None,
        dtype=None,
        name: str | None = None,
    ):
        super().__init__()
        tp = group_size(group)
        label = name or f"VocabParallelEmbedding(num_embeddings={num_embeddings}, embedding_dim={embedding_dim})"
        _check_divisible(label, "num_embeddings (vocab size)", num_embeddings, tp)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.tp, self.rank = group, tp, group_rank(group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.vocab_start = self.rank * (num_embeddings // tp)
        self.vocab_end = self.vocab_start + num_embeddings // tp
        if padding_idx is not None:  # as nn.Embedding does
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{label}: padding_idx={padding_idx} must be within num_embeddings")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        if _is_meta(device):
            weight = torch.empty(num_embeddings, embedding_dim, device="meta", dtype=dtype)
        else:  # nn.Embedding's RNG stream
            weight = nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype).weight.detach()
            if padding_idx is not None:
                weight[padding_idx].zero_()
        self._load_full(weight)

    def _load_full(self, weight: torch.Tensor, requires_grad: bool = True) -> None:
        w = shard_tensor(weight.detach(), 0, self.rank, self.tp)  # (V/tp, H)
        self.weight = _mark(_param(w, requires_grad), 0, self.group, self.tp)
        p = self.padding_idx
        self._local_padding_idx = (
            p - self.vocab_start if p is not None and self.vocab_start <= p < self.vocab_end else None
        )

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        group=None,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        name: str | None = None,
    ) -> VocabParallelEmbedding:
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            group=group,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            device="meta",
            dtype=embedding.weight.dtype,
            name=name,
        )
        layer._load_full(embedding.weight, embedding.weight.requires_grad)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, T)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight, self._local_padding_idx)  # (B, T, H) this rank's rows
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.sequence_dim, self.group)  # (B, T/tp, H)
        return reduce_from_parallel_region(y, self.group)  # (B, T, H)

    def full_weight(self) -> torch.Tensor:
        """(V, H) on every rank. Collective."""
        return gather_shards(self.weight, 0, self.group)

    def to_embedding(self) -> nn.Embedding:
        w = self.full_weight()
        return nn.Embedding(w.shape[0], w.shape[1], self.padding_idx, _weight=w)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, tp={self.tp}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )
