"""The layout of a run's --output_dir, and what can be read of it without loading a tensor.

    list_checkpoints(out)            complete checkpoint-<step>/ directories inside out, oldest first
    resolve_resume("latest", out)    the newest complete one that verifies (None: a fresh run), or a PATH verified
    read_trainer_state(ckpt)         trainer_state.json: step, world size, dp/tp/ep/cp/pp, strategy, global batch

Layout (hfpar.checkpoint.checkpointer writes it, the preflight, the backends and `hfpar export` read it):
    checkpoint-<step>/      a resumable training state:
        trainer_state.json              step, world size, dp/tp/ep/cp/pp, strategy, global batch (read before loading)
        config.json (+ tokenizer)       so that `hfpar export` needs the checkpoint only
        model.safetensors | pytorch_model_fsdp_0/ | DeepSpeed folder + `latest`    Accelerate's save_state
        rank<r>_of<world>.pt            per-rank shards hfpar owns (FSDP2 x TP/EP, experts)
        tp_rank<t>_of<tp>.pt            one file per TP rank (TP x DDP: dp replicas are identical)
        rng_state_<rank>.safetensors    each rank's generators (Python, numpy, torch); scheduler.json: the LR schedule
        MANIFEST.json                   every file's size and SHA-256 (manifest.py), written after them
        COMPLETE                        marker, written last
    .checkpoint-<step>.tmp/ a save in progress (renamed to checkpoint-<step>/ once flushed)
    config.json, model*.safetensors, tokenizer files   (final export, from_pretrained-loadable)
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from hfpar.checkpoint.manifest import MANIFEST, verify
from hfpar.config import ConfigError
from hfpar.loading.json_limits import read_json

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def staging_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where a save of `step` is written before it becomes checkpoint_dir(step)."""
    return Path(output_dir) / f".checkpoint-{step}.tmp"


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints inside output_dir, oldest first (a checkpoint-<step> symlink out of it is not one)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _CKPT_RE.match(child.name)
        if m and (child / MARKER).is_file() and _inside(child, root):
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def escaping_links(output_dir: str | os.PathLike) -> list[Path]:
    """checkpoint-<step> entries of output_dir that resolve outside it (never picked by `latest`)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted(c for c in root.iterdir() if _CKPT_RE.match(c.name) and not _inside(c, root))


def is_hfpar_checkpoint(path: str | os.PathLike) -> bool:
    """A checkpoint hfpar wrote: a real directory (not a symlink) with its COMPLETE marker and MANIFEST.json. Only
    these are ever deleted (retention), replaced (a step saved again) or moved by hfpar."""
    path = Path(path)
    return not path.is_symlink() and path.is_dir() and (path / MARKER).is_file() and (path / MANIFEST).is_file()


def has_any_checkpoint(output_dir: str | os.PathLike) -> bool:
    root = Path(output_dir)
    return root.is_dir() and any(_CKPT_RE.match(c.name) for c in root.iterdir())


_VERIFIED: dict[tuple, str | None] = {}  # (path, its files' stats) -> verify()'s answer: each process hashes once


def verified(path: Path) -> str | None:
    """manifest.verify(path), remembered for this process (the recipe, the preflight and the Checkpointer ask)."""
    stats = tuple(
        (str(p), st.st_size, st.st_mtime_ns) for p in sorted(Path(path).rglob("*")) for st in [p.lstat()]
    )  # a file changed since the last answer is hashed again
    key = (str(Path(path).resolve()), stats)
    if key not in _VERIFIED:
        _VERIFIED[key] = verify(path)
    return _VERIFIED[key]


def _warn(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"hfpar: warning: {line}", file=sys.stderr)


def resolve_resume(resume: str | None, output_dir: str) -> Path | None:
    """`latest` -> the newest complete checkpoint inside output_dir that verifies against its manifest (each newer
    damaged one skipped with a one-line warning), or None on a fresh run; ConfigError when checkpoints exist and
    none verifies. A PATH (passed explicitly: it may be anywhere) must be complete and verify."""
    if not resume:
        return None
    if resume == "latest":
        for link in escaping_links(output_dir):
            _warn(f"{link} points outside --output_dir {output_dir}: ignored by 'latest' (pass its path to use it)")
        ckpts = list_checkpoints(output_dir)
        problems = []
        for path in reversed(ckpts):
            problem = verified(path)
            if problem is None:
                return path
            problems.append(problem)
            _warn(f"skipping {path.name}: {problem}")
        if ckpts:
            raise ConfigError(
                f"--resume_from_checkpoint latest: none of the {len(ckpts)} checkpoint(s) in {output_dir} "
                f"verifies (newest: {problems[0]}); pass --overwrite_output_dir to start over"
            )
        return None
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(
            f"--resume_from_checkpoint {resume}: no such directory (use 'latest' or a checkpoint-<step> dir)"
        )
    if not (path / MARKER).is_file():
        raise ConfigError(
            f"--resume_from_checkpoint {resume}: checkpoint is incomplete (no {MARKER} marker); pick an earlier one"
        )
    problem = verified(path)
    if problem is not None:
        raise ConfigError(f"--resume_from_checkpoint {resume}: damaged: {problem}; pick an earlier checkpoint")
    return path


def run_identity(args) -> dict:
    """What makes two launches the same run (written into trainer_state.json; `latest` refuses a checkpoint of
    another): the model, the data (its name, and the bytes of a local file or dir), the seed. The global batch is
    checked on its own (preflight)."""
    data = getattr(args, "dataset_name", None)
    size = None
    if data and Path(data).exists():
        files = [Path(data)] if Path(data).is_file() else sorted(p for p in Path(data).rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in files)
    return {"model": str(args.model_name_or_path), "data": data or "embedded", "data_bytes": size, "seed": args.seed}


def identity_problem(state: dict, args, path: Path) -> str | None:
    """Why checkpoint `path` (its trainer state) is not this run's to resume by `latest`, or None."""
    mine, theirs = run_identity(args), state.get("identity")
    if theirs is not None:
        differ = [k for k in mine if theirs.get(k) != mine[k]]
        if differ:
            return (
                f"checkpoint {path} belongs to another run ({', '.join(f'{k} {theirs.get(k)!r}' for k in differ)}; "
                f"this run: {', '.join(f'{k} {mine[k]!r}' for k in differ)}): pass its path to "
                "--resume_from_checkpoint to resume it anyway, or use another --output_dir"
            )
    max_steps = getattr(args, "max_steps", -1)
    if max_steps > 0 and state.get("global_step", 0) > max_steps:
        return (
            f"checkpoint {path} is at step {state['global_step']}, past this run's --max_steps {max_steps}: it "
            "belongs to a longer run; pass its path to --resume_from_checkpoint to resume it anyway, or use "
            "--overwrite_output_dir / another --output_dir"
        )
    return None


PREVIOUS_RUN = (
    "metrics.jsonl",
    "completions.jsonl",
    "run_info.json",
    "report.png",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    "pytorch_model.bin",
)


def previous_run_files(output_dir: str | os.PathLike) -> list[Path]:
    """What a finished (or started) run left at the output dir's root: its records and final model, checkpoints."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted(
        c
        for c in root.iterdir()
        if c.name in PREVIOUS_RUN
        or _CKPT_RE.match(c.name)
        or re.match(r"^model-\d+-of-\d+\.safetensors$", c.name)
        or re.match(r"^\.checkpoint-\d+\.tmp$", c.name)
    )


def rank_state_file(ckpt_dir: str | os.PathLike, ctx) -> Path:
    return Path(ckpt_dir) / f"rank{ctx.rank:03d}_of{ctx.world:03d}.pt"


def tp_state_file(ckpt_dir: str | os.PathLike, ctx) -> Path:
    return Path(ckpt_dir) / f"tp_rank{ctx.tp_rank:02d}_of{ctx.tp:02d}.pt"


def has_rank_shards(ckpt_dir: str | os.PathLike) -> bool:
    """Per-rank model-parallel shards (TP / EP), which only a run with the same sizes can read back."""
    ckpt_dir = Path(ckpt_dir)
    return any(ckpt_dir.glob("tp_rank*_of*.pt")) or any(ckpt_dir.glob("rank*_of*.pt"))


def model_state_kind(ckpt_dir: str | os.PathLike) -> str | None:
    """Which writer holds the model weights of a checkpoint: safetensors | bin | dcp | deepspeed | None."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "model.safetensors").is_file():
        return "safetensors"
    if (ckpt_dir / "pytorch_model.bin").is_file():
        return "bin"
    if (ckpt_dir / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return "dcp"
    if (ckpt_dir / "latest").is_file():
        return "deepspeed"
    return None


# each integer of hfpar's trainer state and its least valid value; RESUME_KEYS: those a resume needs
_STATE_INTS = {"global_step": 0, "global_batch": 1, "world_size": 1, "dp": 1, "tp": 1, "ep": 1, "cp": 1, "pp": 1}
RESUME_KEYS = ("global_step", "global_batch", "world_size")
MAX_STATE_BYTES = 1 << 20


def read_trainer_state(path: Path, required: tuple[str, ...] = ("global_step",)) -> dict:
    """trainer_state.json of a checkpoint (step, world size, dp/tp/ep, global batch): cheap, loads no tensors.
    An untrusted file: anything but hfpar's shape (`required` keys present, its numbers integers) is a ConfigError
    naming the file and what is wrong."""
    f = Path(path) / STATE_FILE
    if f.is_symlink() or not f.is_file():
        raise ConfigError(f"{f}: {'a symlink, refused' if f.is_symlink() else 'missing'} (the checkpoint's state)")
    state, problem = read_json(f, limit=MAX_STATE_BYTES)  # size, nesting and syntax bounded
    if problem:
        raise ConfigError(f"{problem}; not hfpar's trainer state")
    if not isinstance(state, dict):
        raise ConfigError(f"{f}: holds a JSON {type(state).__name__}, hfpar's trainer state is an object")
    for key, least in _STATE_INTS.items():
        if key not in state and key not in required:
            continue
        v = state.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            got = "no such key" if key not in state else f"{v!r}"
            raise ConfigError(f"{f}: {key!r} must be an integer >= {least} ({got}); not hfpar's trainer state")
    return state


def deepspeed_tag(ckpt: str | os.PathLike) -> Path:
    """The directory a DeepSpeed checkpoint's `latest` file names: a plain tag (no path separator, no `..`) of a real
    directory inside the checkpoint; else ConfigError (the file is untrusted: it could name any directory)."""
    ckpt = Path(ckpt)
    latest = ckpt / "latest"
    if latest.is_symlink() or not latest.is_file() or latest.stat().st_size > 4096:
        raise ConfigError(f"{latest}: not a DeepSpeed `latest` file (a symlink, missing or too large)")
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except ValueError:
        raise ConfigError(f"{latest}: not UTF-8 text; it should name a folder of the checkpoint") from None
    target = ckpt / tag
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag:
        raise ConfigError(
            f"{latest} names {tag[:80]!r}: valid is a plain folder name inside {ckpt} (no path separator, no '..')"
        )
    if target.is_symlink() or not target.is_dir():
        raise ConfigError(f"{latest} names {tag!r}: {'a symlink' if target.is_symlink() else 'no such folder'}")
    return target
