"""Weights handed over in place, between processes of one GPU (or one host): no copy on the wire.

SGLang's /update_weights_from_tensor takes, per TP rank, a list of (name, tensor) pickled the way
torch.multiprocessing pickles tensors (MultiprocessingSerializer: ForkingPickler, then base64 in
the JSON body). A CUDA tensor pickles as a CUDA IPC handle of its allocation, so what crosses
HTTP is a few hundred bytes per tensor, and the receiver reads the sender's memory. rlctl packs a
bucket into one buffer and hands it over whole, as SGLang's load_format "flattened_bucket" takes
it (dumps_bucket): one tensor, the buffer, and each weight's name, shape, dtype and byte range in
it, as SGLang's FlattenedTensorMetadata. So a bucket costs one IPC handle on each side (torch
records an event and takes a reference for every tensor it pickles), not one per weight. The
list of (name, tensor) that load_format null takes (dumps) is still what SGLang senders may send.

The pickles are SGLang's own (tests/test_weight_ipc.py reads its SafeUnpickler allowlist from
the wheels of the releases rlctl speaks): the functions referenced are torch's rebuild_tensor,
rebuild_typed_storage, rebuild_storage_filename and rebuild_cuda_tensor. Like SGLang's
monkey_patch_torch_reductions, the device of a CUDA tensor travels as the GPU's UUID instead of
an index, so that sender and receiver may number their visible GPUs differently; SGLang patches
its own rebuild_cuda_tensor before unpickling, and rlctl's built-in server maps the UUID itself.
CPU tensors travel as torch's named shared-memory files (its file_system strategy), to rlctl's
built-in server only (SGLang serves CUDA only).

The receiving side is rlctl's built-in server (ipc_open.py), which opens only what this run's
trainer shares: every buffer the sender hands over ends in a tag (tag_buffer: HMAC-SHA256, keyed
by the run's token, of the buffer's size), and the server refuses a storage that does not end in
the tag its own copy of the token makes. Only a process that can write the memory and knows the
token can put the tag there, so a request that names any other shared memory of the host is
refused. The tag lies past the bucket's tensors, in bytes SGLang never looks at: what SGLang
receives is its own format. A CPU payload names no shared-memory manager (the server connects to
none) and takes no reference on the file: the trainer keeps it until the server's reply.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import math
import pickle
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DEVICE_ARG = 6  # torch's reduce_tensor for CUDA: args[6] is the device index (SGLang swaps in the UUID)
TAG_BYTES = 32
"""The tag at the end of every buffer handed over (SHA-256's size)."""

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
REBUILDERS = ("rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_cuda_tensor")
ALLOWED = {
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),  # the storage class a CUDA tensor's pickle names
    *(("torch", d) for d in DTYPES),
    *(("torch.multiprocessing.reductions", f) for f in REBUILDERS),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
}
"""What a weight pickle may reference: rlctl's own pickles use the torch names; an SGLang
sender's patched pickles name SGLang's rebuild function. The receiver (ipc_open.py) answers
each with a function of its own that checks its arguments, and each class with a name that
cannot be called."""


def ipc_key(token: str | None) -> bytes:
    """The key of the tags, from the run's token (none outside a run: an open server's)."""
    return hmac.new((token or "").encode(), b"rlctl weight-sync ipc", hashlib.sha256).digest()


def tag_for(key: bytes, nbytes: int) -> bytes:
    """The tag a buffer of `nbytes` (tag included) ends in."""
    return hmac.new(key, b"rlctl ipc buffer %d" % nbytes, hashlib.sha256).digest()


def tag_buffer(buf: torch.Tensor, key: bytes) -> None:
    """Write the tag into the last TAG_BYTES of `buf`, a uint8 buffer that is its storage whole."""
    import torch

    if buf.dtype != torch.uint8 or buf.storage_offset() or buf.numel() != buf.untyped_storage().nbytes():
        raise ValueError("only a whole uint8 buffer can carry the IPC tag")
    tag = tag_for(key, buf.numel())
    buf[-TAG_BYTES:].copy_(torch.frombuffer(bytearray(tag), dtype=torch.uint8))


def gpu_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


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
    _, handle, size = storage._share_filename_cpu_()  # into a named shared-memory file, once
    # No manager and no reference for the receiver: rlctl's server maps the file itself, read-only.
    untyped = _Reduced(reductions.rebuild_storage_filename, (torch.UntypedStorage, b"", handle, size))
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


FLAT_META = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
"""The class a flattened bucket's metadata entries are made with, on SGLang's side."""
FLATTENED_BUCKET = "flattened_bucket"
"""The load_format of a flattened bucket's payload (/update_weights_from_tensor)."""


class FlatMeta:
    """One metadata entry of a flattened bucket, pickled as a call of SGLang's
    FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel) (byte offsets into the
    flattened tensor; numel counts its uint8 elements: bytes). SGLang need not be importable here:
    the pickle names this class, and dumps_bucket puts SGLang's name in its place."""

    __slots__ = ("args",)

    def __init__(self, *args) -> None:
        self.args = args

    def __reduce__(self):
        return FlatMeta, self.args


# Protocol 3 names a global in one text line (GLOBAL: "c" module "\n" name "\n") and, unlike 2,
# pickles bytes (an IPC handle) without naming a global for them; 4 would frame the stream.
_PROTOCOL = 3
_OURS = b"c%s\n%s\n" % (__name__.encode(), FlatMeta.__qualname__.encode())
_SGLANGS = b"c%s\n%s\n" % tuple(part.encode() for part in FLAT_META)


def dumps_bucket(flat: torch.Tensor, metas: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> str:
    """One TP rank's payload of a flattened bucket: {"flattened_tensor": the used prefix of the
    packed uint8 buffer `flat`, "metadata": [FlattenedTensorMetadata, ...]}, the dict SGLang's
    load_format "flattened_bucket" unpickles, base64. `metas` are the bucket's tensors in the
    order they lie in `flat`, back to back."""
    import torch

    entries, offset = [], 0
    for name, dtype, shape in metas:
        n = math.prod(shape) * dtype.itemsize
        entries.append(FlatMeta(name, torch.Size(shape), dtype, offset, offset + n, n))
        offset += n
    return pickle_bucket(flat[:offset], entries)


def pickle_bucket(flattened: torch.Tensor, entries: list[FlatMeta]) -> str:
    """{"flattened_tensor": flattened, "metadata": entries} pickled as SGLang's flattened-bucket
    payload, base64: the entries as calls of SGLang's FlattenedTensorMetadata."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=_PROTOCOL).dump({"flattened_tensor": flattened, "metadata": entries})
    data = buf.getvalue()
    if data.count(_OURS) != 1:  # the pickle memoizes a global after its first use
        raise RuntimeError(f"a flattened bucket's pickle names its metadata class {data.count(_OURS)} times, not once")
    return base64.b64encode(data.replace(_OURS, _SGLANGS)).decode("ascii")
