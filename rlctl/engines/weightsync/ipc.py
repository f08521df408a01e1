"""Weights handed over in place, between processes of one GPU (or one host): no copy on the wire.

SGLang's /update_weights_from_tensor takes, per TP rank, a list of (name, tensor) pickled the way
torch.multiprocessing pickles tensors (MultiprocessingSerializer: ForkingPickler, then base64 in
the JSON body). A CUDA tensor pickles as a CUDA IPC handle of its allocation, so what crosses
HTTP is a few hundred bytes per tensor, and the receiver reads the sender's memory. rlctl packs a
bucket into one buffer and sends views of it: every tensor of the bucket names the same
allocation, which the receiver opens once.

The pickles are SGLang's own (tests/test_weight_ipc.py reads its SafeUnpickler allowlist from
the wheels of the releases rlctl speaks): the functions referenced are torch's rebuild_tensor,
rebuild_typed_storage, rebuild_storage_filename and rebuild_cuda_tensor. Like SGLang's
monkey_patch_torch_reductions, the device of a CUDA tensor travels as the GPU's UUID instead of
an index, so that sender and receiver may number their visible GPUs differently; SGLang patches
its own rebuild_cuda_tensor before unpickling, and rlctl's built-in server maps the UUID itself.
CPU tensors travel as torch's named shared-memory files (its file_system strategy), which any
process of the host can open.

The receiving side unpickles with an allowlist (load), as SGLang's SafeUnpickler does: a pickle
from the network runs no other code.
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_DEVICE_ARG = 6  # torch's reduce_tensor for CUDA: args[6] is the device index (SGLang swaps in the UUID)

ALLOWED = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "str"), ("builtins", "int"), ("builtins", "bool"),
    ("builtins", "bytes"), ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("_codecs", "encode"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),  # the storage class a CUDA tensor's pickle names
    ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"), ("torch", "float64"), ("torch", "int64"),
    ("torch", "int32"), ("torch", "int8"), ("torch", "uint8"), ("torch", "bool"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
}
"""What a weight pickle may reference: rlctl's own pickles use the torch names; an SGLang
sender's patched pickles name SGLang's rebuild function, which load() answers itself."""


def gpu_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _local_gpu(device: int | str) -> int:
    """The index here of a GPU given as an index or UUID (what SGLang's patched pickles carry)."""
    import torch

    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == device:
            return index
    raise ValueError(f"the weights are on GPU {device}, which this process does not see: "
                     "CUDA IPC needs sender and server on one GPU (use sync_backend nccl or gloo)")


def _rebuild_cuda(*args):
    from torch.multiprocessing import reductions

    args = (*args[:_DEVICE_ARG], _local_gpu(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


class _Reduced:
    """Pickles as fn(*args): a nested reduction inside a tensor's arguments."""

    def __init__(self, fn, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _reduce_cpu(t: torch.Tensor):
    import torch
    from torch.multiprocessing import reductions

    storage = t.untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()  # into a named shared-memory file, once
    storage._shared_incref()  # the receiver's rebuild_storage_filename takes it back
    untyped = _Reduced(reductions.rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size))
    typed = _Reduced(reductions.rebuild_typed_storage, (untyped, t.dtype))
    meta = (t.storage_offset(), t.size(), t.stride(), False)
    return reductions.rebuild_tensor, (torch.Tensor, typed, meta)


def _reduce_cuda(t: torch.Tensor):
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(t)
    device = args[_DEVICE_ARG]
    if isinstance(device, int):
        device = gpu_uuid(device)
    return fn, (*args[:_DEVICE_ARG], device, *args[_DEVICE_ARG + 1:])


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        import torch

        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            return _reduce_cuda(t) if t.is_cuda else _reduce_cpu(t)
        return NotImplemented


def dumps(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """One TP rank's payload: the list pickled as SGLang's MultiprocessingSerializer would, base64."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(list(named_tensors))
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        if name in ("rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified"):
            return _rebuild_cuda
        return super().find_class(module, name)


def loads(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The receiving side: (name, tensor) pairs; the tensors are the sender's memory, mapped."""
    import torch

    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    named = _Unpickler(io.BytesIO(data)).load()
    if not isinstance(named, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return named
