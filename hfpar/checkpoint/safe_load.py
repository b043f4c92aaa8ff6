"""Reading a checkpoint without running code from it: every unpickling a resume or an export reaches is restricted.

    check_dcp_metadata(ckpt)             # FSDP2's DCP metadata, refused in one line before DCP reads it
    with safe_loading():                 # around accelerator.load_state, the backends' load_rank_state, export
        accelerator.load_state(ckpt)     # a planted pickle fails with CheckpointError naming the file, never runs

Files under a checkpoint dir are untrusted (a shared output dir, a copied checkpoint). The libraries hfpar resumes
through read pickles, and hfpar cannot change what they write:
  - Accelerate's `custom_checkpoint_<i>.pkl` (registered objects) is read with torch.load(weights_only=False)
    (accelerate.checkpointing.load_custom_state); hfpar no longer registers anything (the scheduler goes to JSON,
    checkpointer.py), but a planted file would still be read if it were registered: forced to weights_only here;
  - DeepSpeed's engine and zero_to_fp32 read its *_states.pt with torch.load(weights_only=False); the files hold
    tensors plus three DeepSpeed classes (LossScaler, ZeroStageEnum, fragment_address), allowlisted below;
  - torch.distributed.checkpoint (FSDP2's DCP) reads `.metadata` with plain pickle.load
    (filesystem.FileSystemReader.read_metadata): read here by an Unpickler that resolves only DCP's metadata
    dataclasses, torch dtypes / layouts / Size and PosixPath (Python's "restricting globals" recipe).
So inside safe_loading() every torch.load runs with weights_only=True (torch's own restricted unpickler: tensors,
containers, numbers, strings and the allowlisted classes), whatever its caller asked, and DCP's metadata goes through
the restricted Unpickler. A file outside those types is refused in one line naming it (CheckpointError).

An enum member is pickled in one of two forms, depending on the build that wrote it: `Cls(value)` (REDUCE on the
class) or `getattr(Cls, 'NAME')` (Python's enum.pickle_by_enum_name; seen in checkpoints written under PyPI's CUDA
build of torch, issue #37). Both readers accept the second form through `enum_member` only: `builtins.getattr`
resolves to it, and it returns a member of an allowlisted enum class, by name, and refuses anything else.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import io
import pathlib
import pickle
import types
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

from hfpar.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint file that cannot be trusted or read; the message is one line naming the file."""


def _deepspeed_globals() -> list:
    """The classes DeepSpeed pickles into its ZeRO optimizer states (found by scanning the files every ZeRO stage,
    bf16 and pipeline composition writes); empty without DeepSpeed."""
    try:  # an optional dependency (hfpar[deepspeed]); only ZeRO checkpoints hold these classes
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: PLC0415
        from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: PLC0415
        from deepspeed.utils.tensor_fragment import fragment_address  # noqa: PLC0415
    except ImportError:
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@functools.cache
def _allowed_enums() -> frozenset:
    """The enum classes a checkpoint may name a member of: DCP's own (its metadata's _MEM_FORMAT_ENCODING) and the
    allowlisted DeepSpeed ones (ZeroStageEnum); not those of the enum module itself (Enum, Flag, ...). Found once."""
    found = [*vars(dcp_metadata).values(), *_deepspeed_globals()]
    return frozenset(c for c in found if isinstance(c, enum.EnumMeta) and c.__module__ != enum.__name__)


def enum_member(cls, name):
    """What `builtins.getattr` means in a checkpoint's pickle: getattr(<allowed enum class>, <member name>), nothing
    else (a method, a dunder, a module's function, another class's attribute are refused)."""
    if cls not in _allowed_enums() or not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(
            f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not "
            "allowed in a checkpoint (only a member of an allowlisted enum class)"
        )
    return cls.__members__[name]


_DCP_CLASSES = {
    ("builtins", "getattr"): enum_member,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "Path"): pathlib.Path,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
}


class MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes and plain torch values only; anything else (os.system, builtins.eval, ...)
    is refused before it can be called."""

    def find_class(self, module: str, name: str):
        obj = getattr(dcp_metadata, name, None) if module == dcp_metadata.__name__ else None
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__:  # its own classes, not what it imports
            return obj
        if (module, name) in _DCP_CLASSES:
            return _DCP_CLASSES[(module, name)]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint's metadata")


def _load_metadata(fh) -> object:
    name = getattr(fh, "name", "DCP .metadata")
    try:
        return MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{name}: refused to read it ({first_line(exc)})") from None


def check_dcp_metadata(ckpt: Path) -> None:
    """Every DCP `.metadata` of a checkpoint read once with MetadataUnpickler before DCP opens it: DCP would wrap
    the refusal in a multi-rank CheckpointException with tracebacks; this says it in one line first."""
    for meta in sorted(Path(ckpt).rglob(".metadata")):
        with open(meta, "rb") as fh:
            _load_metadata(fh)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _dcp_refusal(exc: CheckpointException, where) -> CheckpointError:
    """DCP wraps each rank's failure (ours included) in a CheckpointException holding tracebacks: one line of it."""
    ours = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointError)]  # {rank: (exception, trace)}
    detail = first_line(ours[-1] if ours else exc)
    return CheckpointError(f"{where}: a torch.distributed.checkpoint shard refused: {detail[:240]}")


@contextlib.contextmanager
def safe_loading(where: str | Path = "checkpoint"):
    """Every torch.load with weights_only=True (allowlisting DeepSpeed's three classes) and DCP's metadata through
    MetadataUnpickler, for the duration; a refused file raises CheckpointError naming it (a DCP shard read from an
    in-memory buffer: naming `where`)."""
    original_load = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True  # whatever the library asked (Accelerate and DeepSpeed pass False)
        name = f if isinstance(f, (str, pathlib.PurePath)) else getattr(f, "name", "a file read from memory")
        try:
            with torch.serialization.safe_globals([*_deepspeed_globals(), (enum_member, "builtins.getattr")]):
                return original_load(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{name}: refused to unpickle it: it holds more than tensors and plain values ({first_line(exc)[:160]})"
            ) from None
        except (RuntimeError, EOFError) as exc:
            if isinstance(f, io.IOBase):
                raise
            raise CheckpointError(f"{name}: unreadable ({first_line(exc)[:160]})") from None

    shim = types.SimpleNamespace(
        **{k: getattr(pickle, k) for k in ("dump", "dumps", "HIGHEST_PROTOCOL")}, load=_load_metadata
    )
    saved_pickle = dcp_filesystem.pickle
    torch.load, dcp_filesystem.pickle = load, shim
    try:
        yield
    except CheckpointException as exc:
        raise _dcp_refusal(exc, where) from None
    finally:
        torch.load, dcp_filesystem.pickle = original_load, saved_pickle
