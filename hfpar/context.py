"""ParallelContext: every parallel degree, validated once, and every process group, built once.

    ctx = ParallelContext.from_degrees(world=8, rank=r, tp=2, ep=2)   # validates; raises ContextError (all problems)
    ctx.build_groups()                                         # collective: every rank, once
    apply_tensor_parallel(model, ctx); apply_expert_parallel(model, ctx)
    backend = select_backend(strategy, parallelisms)(accelerator, ctx, strategy, args)   # hfpar.backends

Rank layout (tp innermost, so a TP group stays inside a node when tp <= GPUs per node):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank        world = pp x dp x cp x tp

EP ranks are drawn from the dp x cp ranks (as torchtitan borrows them from dp_shard x cp): inside a replica group
R (dp x cp, cp innermost), EP groups are runs of ep consecutive entries, so the cp ranks of a replica come first,
and the expert-data-parallel group (ranks holding the same experts) is R[j::ep]. Each cp rank routes the tokens of
its own part of the sequence; with cp 1 this is the dp group. The cp ranks of a replica share
its rows (each holds its part of every sequence); each pp rank holds its pipeline stage (V chunks
under the interleaved schedule).
Everything downstream receives this object; nothing reads degrees back from model attributes.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from hfpar.parallel.expert_parallel import config_num_experts
from hfpar.parallel.groups import expert_rank_lists, new_groups
from hfpar.parallel.language_model import text_config

AXES = ("pp", "dp", "cp", "tp")


class ContextError(ValueError):
    """Inconsistent parallel degrees; one line per problem."""


@dataclass
class ParallelContext:
    world: int = 1
    rank: int = 0
    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    strategy: object = None  # the data-parallel strategy in effect (hfpar.backends.Strategy), resolved once by
    # the preflight; everything downstream reads its attributes from here
    groups: dict = field(default_factory=dict, repr=False)  # name -> this rank's group (after build_groups)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_degrees(
        cls,
        world: int,
        rank: int = 0,
        *,
        tp: int = 1,
        ep: int = 1,
        cp: int = 1,
        pp: int = 1,
        sequence_parallel: bool = False,
        strategy=None,
    ) -> ParallelContext:
        """The context of these degrees, validated (no groups yet: build_groups); ContextError with every problem."""
        ctx = cls(
            world=world, rank=rank, tp=tp, ep=ep, cp=cp, pp=pp, sequence_parallel=sequence_parallel, strategy=strategy
        )
        problems = ctx.problems()
        if problems:
            raise ContextError("\n".join(problems))
        return ctx

    plan = from_degrees  # the name before issue 38 (public API, kept): "plan" now names tensor-parallel plans only

    def problems(self) -> list[str]:
        """Every degree problem, one line each (no collective, no groups needed)."""
        p = []
        if self.world < 1 or not 0 <= self.rank < self.world:
            p.append(
                f"rank {self.rank} of world size {self.world}: the launcher's world must be >= 1 and hold the rank"
            )
        for name in ("tp", "ep", "cp", "pp"):
            if getattr(self, name) < 1:
                p.append(f"--{name}_size {getattr(self, name)}: must be a positive integer")
        model = self.tp * self.cp * self.pp
        if not p and self.world % model:  # (divisibility is meaningless while a degree itself is wrong)
            degrees = {n: getattr(self, n) for n in ("tp", "cp", "pp") if getattr(self, n) > 1}
            what = " x ".join(f"--{n}_size {d}" for n, d in degrees.items())
            flag = next(reversed(degrees))  # the valid values of the last degree, others kept
            others = model // degrees[flag]
            valid = [d for d in range(1, self.world + 1) if self.world % (d * others) == 0]
            p.append(
                f"{what}{f' = {model}' if len(degrees) > 1 else ''} does not divide the world size {self.world} "
                f"(world = data-parallel size x model-parallel degrees; valid --{flag}_size here: "
                + (", ".join(map(str, valid)) or "none")
                + ")"
            )
        elif not p and (self.dp * self.cp) % self.ep:  # experts are drawn from the dp x cp ranks
            n = self.dp * self.cp
            what = (
                f"data-parallel x context-parallel size {self.dp} x {self.cp}"
                if self.cp > 1
                else f"data-parallel size {self.dp}"
            )
            p.append(
                f"--ep_size {self.ep} does not divide the {what} "
                f"(world {self.world} / tp {self.tp}{f' / pp {self.pp}' if self.pp > 1 else ''}); valid --ep_size: "
                + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            )
        if self.sequence_parallel and self.tp == 1:
            p.append("--sequence_parallel needs --tp_size > 1")
        return p

    # ------------------------------------------------------------------ degrees and coordinates
    @property
    def dp(self) -> int:
        return max(1, self.world // (self.tp * self.cp * self.pp))

    def _coords(self) -> dict[str, int]:
        r, out = self.rank, {}
        for name, size in zip(reversed(AXES), (self.tp, self.cp, self.dp, self.pp)):
            out[name] = r % size
            r //= size
        return out

    @property
    def cp_rank(self) -> int:
        return self._coords()["cp"]

    @property
    def tp_rank(self) -> int:
        return self._coords()["tp"]

    @property
    def dp_rank(self) -> int:
        return self._coords()["dp"]

    @property
    def pp_rank(self) -> int:
        return self._coords()["pp"]

    @property
    def pp_peers(self) -> list[int]:
        """Global rank of every stage of this rank's pipeline (stage order)."""
        return next(r for r in self.rank_lists("pp") if self.rank in r)

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group: its index in the replica group (dp x cp, cp innermost) mod ep."""
        return (self.dp_rank * self.cp + self.cp_rank) % self.ep

    @property
    def model_parallel(self) -> bool:
        """A model-parallel dimension is in use (tp, ep, cp or pp: `parallelisms`), i.e. more than data parallelism;
        which backend wraps and reduces then is the support table's choice (CP alone: Accelerate's)."""
        return bool(self.parallelisms)

    @property
    def parallelisms(self) -> tuple[str, ...]:
        """The model-parallel dimensions in use, e.g. ("tp",), ("ep",); () for plain data parallelism."""
        return tuple(n for n in ("tp", "ep", "cp", "pp") if getattr(self, n) > 1)

    @property
    def data_replicas(self) -> int:
        """Ranks that see the same rows and report the same full per-token losses (TP ranks of a replica; the stages
        of a pipeline, which all get the last stage's loss; the cp ranks of a replica see the same rows but each
        computes the loss of its own part of the sequence)."""
        return self.tp * self.pp

    @property
    def grad_replicas(self) -> int:
        """Ranks holding the same parameters whose grads the backend averages: dp x cp (each cp rank's grad is the
        part of the sequence it holds, so the loss is scaled by dp x cp and the average restores the sum)."""
        return self.dp * self.cp

    @property
    def seq_multiple(self) -> int:
        """Rows are padded to a multiple of this: 2 cp chunks per cp group (load balance), x tp under SP."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sequence_parallel else 1)

    def as_dict(self) -> dict[str, int]:
        return {
            "world_size": self.world,
            "dp_size": self.dp,
            "tp_size": self.tp,
            "ep_size": self.ep,
            "cp_size": self.cp,
            "pp_size": self.pp,
        }

    # ------------------------------------------------------------------ groups
    def rank_lists(self, *axes: str) -> list[list[int]]:
        """All groups spanning the given axes of the (pp, dp, cp, tp) grid (one axis, or several flattened in
        grid order, e.g. ("dp", "cp")), each as its list of global ranks."""
        grid = torch.arange(self.world).view(self.pp, self.dp, self.cp, self.tp)
        dims = [AXES.index(a) for a in axes]
        size = 1
        for d in dims:
            size *= grid.shape[d]
        moved = grid.movedim(dims, list(range(grid.dim() - len(dims), grid.dim()))).reshape(-1, size)
        return [row.tolist() for row in moved]

    def build_groups(self) -> ParallelContext:
        """Collective (every rank, same order): tp, dp, cp, pp, ep and expert-dp groups. A no-op without
        torch.distributed (one process): every group is then None, which the layers read as size 1."""
        if self.groups:
            return self
        for axis in ("tp", "dp", "cp", "pp"):
            self.groups[axis] = new_groups(self.rank_lists(axis))
        # the ranks over which replicated grads are averaged: dp x cp (= dp when cp is 1)
        self.groups["replica"] = new_groups(self.rank_lists("dp", "cp"))
        ep_lists, edp_lists = expert_rank_lists(self.rank_lists("dp", "cp"), self.ep)  # EP from dp x cp
        self.groups["ep"] = new_groups(ep_lists)
        self.groups["edp"] = new_groups(edp_lists)
        return self

    @property
    def tp_group(self):
        return self.groups.get("tp")

    @property
    def dp_group(self):
        return self.groups.get("dp")

    @property
    def ep_group(self):
        return self.groups.get("ep")

    @property
    def edp_group(self):
        return self.groups.get("edp")

    @property
    def replica_group(self):
        """dp x cp: where the backends reduce (average) the grads of parameters every rank of it holds whole."""
        return self.groups.get("replica")

    @property
    def expert_groups(self) -> tuple:
        """(ep, routing-statistics, expert-dp) groups for apply_expert_parallel: experts are drawn from the dp x cp
        ranks, so routers gather their statistics over dp x cp (every token of the global batch)."""
        return self.ep_group, self.replica_group, self.edp_group

    @property
    def cp_group(self):
        return self.groups.get("cp")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    def dp_mesh(self, device_type: str):
        """A 1-D DeviceMesh over this rank's dp x cp group (FSDP2 over it only, next to TP / EP)."""
        return DeviceMesh.from_group(self.replica_group, device_type=device_type)


def model_config_problems(ctx: ParallelContext, config) -> list[str]:
    """Divisibility knowable from an HF config alone (no weights): heads and kv heads by tp, vocab and
    intermediate size by tp, experts by ep. One line each, naming the field and the valid degrees."""
    if config is None:
        return []
    cfg = text_config(config)  # a multimodal wrapper: its language model's settings
    p = []

    def need(field_name: str, value, degree: int, opt: str) -> None:
        if isinstance(value, int) and degree > 1 and value % degree:
            valid = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            p.append(
                f"{opt} {degree}: {cfg.model_type}'s {field_name} {value} is not divisible by it "
                f"(valid {opt}: {', '.join(map(str, valid[:12]))})"
            )

    heads = getattr(cfg, "num_attention_heads", None)
    need("num_attention_heads", heads, ctx.tp, "--tp_size")
    need("num_key_value_heads", getattr(cfg, "num_key_value_heads", None) or heads, ctx.tp, "--tp_size")
    need("intermediate_size", getattr(cfg, "intermediate_size", None), ctx.tp, "--tp_size")
    need("vocab_size", getattr(cfg, "vocab_size", None), ctx.tp, "--tp_size")
    experts = config_num_experts(cfg)
    need("number of experts", experts, ctx.ep, "--ep_size")
    return p


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run derives from its options and its model's config, resolved once by the preflight
    (hfpar.preflight.resolve_plan) and passed down to parallelize, the backend and the trainer: nothing downstream
    recomputes it."""

    recipe: str  # the recipe's name (hfpar.recipes)
    task: str  # "lm" | "classify": the model head, the default objective
    model_config: Any  # the model's config.json, read once (transformers PretrainedConfig)
    model_type: str | None
    num_experts: int | None  # routed experts the config declares (None: dense; upcycling is args')
    microbatches: int  # pipeline micro-batches per accumulation step (1 without a pipeline)
    pipeline_stages: int  # stages the layers are cut into (pp, or pp x V interleaved)
    chunks_per_rank: int  # model chunks a pipeline rank holds (V interleaved, else 1)
    padding_free: bool  # the collator packs each micro-batch's samples into rows
    one_row: bool  # ... into ONE row, packed rows concatenated (hfpar.data.padding_free.one_row)
    padding_free_why_not: str | None
    cp_mode: str  # ring | ulysses (--cp_mode auto resolved)
    fp8: Any = None  # hfpar.precision.fp8.FP8Settings under mixed_precision fp8, else None
    # a vision-language model a recipe of image rows trains (Recipe.image_text): AutoModelForImageTextToText builds it
    image_text: bool = False
    recipe_values: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
