"""The safe loaders read the checkpoints hfpar writes in both pickle forms an enum member takes, whatever build of
torch runs the test (issue #37): `Cls(value)` (what the CPU wheel writes) and `getattr(Cls, 'NAME')` (what
checkpoints written under PyPI's CUDA build hold). The second form is produced by a Pickler that reduces every enum
member with Python's own `enum.pickle_by_enum_name` (tests/helpers/planting.py: EnumByName); a `getattr` on anything
but an allowlisted enum's member is still refused.

    python -m pytest -q tests/unit/test_safe_load_forms.py
"""

from __future__ import annotations

import builtins
import enum
import io
import os
import pickle
import pickletools
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from hfpar.checkpoint.safe_load import CheckpointError, MetadataUnpickler, check_dcp_metadata, safe_loading
from tests.helpers.planting import BY_NAME

FORMS = {"by_value": pickle, "by_name": BY_NAME}


def _globals(data: bytes) -> set[str]:
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", ".").replace("__builtin__.", "builtins."))  # protocol 2's name
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
    return found


def _dcp_checkpoint(path, form: str) -> None:
    """A real DCP checkpoint (one process), its .metadata then re-pickled in `form`."""
    dcp.save({"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}, checkpoint_id=str(path))
    meta_file = path / ".metadata"
    with open(meta_file, "rb") as fh:
        meta = pickle.load(fh)  # our own fresh file: trusted
    buf = io.BytesIO()
    FORMS[form].Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(meta)
    meta_file.write_bytes(buf.getvalue())


@pytest.mark.parametrize("form", sorted(FORMS))
def test_dcp_checkpoint_in_either_form_is_read_by_every_dcp_reader(tmp_path, form):
    ckpt = tmp_path / "dcp"
    _dcp_checkpoint(ckpt, form)
    has_getattr = "builtins.getattr" in _globals((ckpt / ".metadata").read_bytes())
    assert has_getattr == (form == "by_name")  # the test really writes the form it names
    check_dcp_metadata(ckpt)  # the one-line pre-check
    with open(ckpt / ".metadata", "rb") as fh:
        props = MetadataUnpickler(fh).load().state_dict_metadata["w"].properties
    assert props.memory_format == torch.contiguous_format
    into = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    with safe_loading(ckpt):  # DCP's own reader, through the patched pickle
        dcp.load(into, checkpoint_id=str(ckpt))
    assert torch.equal(into["w"], torch.arange(6.0).view(2, 3)) and torch.equal(into["b"], torch.ones(3))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_deepspeed_optimizer_state_in_either_form_is_read(tmp_path, form):
    """The shape of a ZeRO *_optim_states.pt: tensors, the ZeroStageEnum member, a loss scaler."""
    state = {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.optimizer_states,
            "loss_scaler": LossScaler(scale=1.0),
            "single_partition_of_fp32_groups": [torch.randn(5)],
        },
        "ds_version": "0.19.8",
    }
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(state, f, pickle_module=FORMS[form])
    with zipfile.ZipFile(f) as z:  # the zip's data.pkl holds the enum in the form asked for
        data = next(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
    assert ("builtins.getattr" in _globals(data)) == (form == "by_name")
    with safe_loading(tmp_path):  # what DeepSpeed's engine and hfpar's zero_state call: torch.load
        got = torch.load(f, weights_only=False)["optimizer_state_dict"]
    assert got["zero_stage"] is ZeroStageEnum.optimizer_states
    assert torch.equal(
        got["single_partition_of_fp32_groups"][0], state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    )


class _GetattrOn:
    """A planted reduction getattr(target, name)."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return builtins.getattr, (self.target, self.name)


PLANTED = {
    "enum method": (ZeroStageEnum, "mro"),
    "enum dunder": (_MEM_FORMAT_ENCODING, "__init__"),
    "not a member": (_MEM_FORMAT_ENCODING, "NOT_A_MEMBER"),
    "allowed non-enum class": (torch.Size, "count"),
    "object's subclasses": (object, "__subclasses__"),
    "non-allowlisted enum": (enum.Flag, "__or__"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_getattr_on_anything_else_is_refused_by_both_readers(tmp_path, name):
    payload = _GetattrOn(*PLANTED[name])
    meta = tmp_path / "dcp" / ".metadata"
    meta.parent.mkdir()
    meta.write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to read it \((global|getattr)"):
        check_dcp_metadata(meta.parent)
    f = tmp_path / "optim_states.pt"
    torch.save({"x": payload}, f)
    with safe_loading(tmp_path), pytest.raises(CheckpointError, match=r"optim_states\.pt: refused to unpickle it"):
        torch.load(f, weights_only=False)


def test_a_planted_getattr_on_a_module_is_refused(tmp_path):
    """getattr(__import__('os'), 'system')('touch x'), hand-written (a module cannot be pickled by reference)."""
    meta = tmp_path / "dcp" / ".metadata"
    meta.parent.mkdir()
    meta.write_bytes(b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(Vtouch x\ntR.")
    with pytest.raises(CheckpointError, match=r"refused to read it \(global builtins.__import__ is not allowed"):
        check_dcp_metadata(meta.parent)
    assert not (tmp_path / "x").exists() and not os.path.exists("x")
