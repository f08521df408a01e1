"""The built-in server's side of /update_weights_from_tensor: a weight pickle opened with checks.

A pickle from the network names what its receiver calls. SGLang's SafeUnpickler lets it name
torch's rebuild functions, which then map whatever shared memory, CUDA allocation or manager
socket the pickle names (docs/security.md). Here every allowed function name (ipc.ALLOWED)
resolves to a method of _Opener that checks its arguments before torch sees them, every allowed
class to a _Name that cannot be called, and no other name resolves. Refused, before anything is
mapped, created or connected:

- a storage that is not a shared handle: nothing in a payload makes a fresh storage or tensor,
  whose bytes would be whatever the allocator last held there;
- shared memory that is not one of the trainer's buffers, and a CUDA storage that reaches past
  its allocation or does not end in the run's tag (ipc_handles.py); a payload that names a
  manager socket (none is used), and a reference-counter file that is not torch's (pattern, owner, size) or an offset outside it;
- a tensor that reaches past its storage (offset plus the extent of its size and strides times
  the element size), a dtype outside ipc.DTYPES, and, against the server's model, an unknown
  name, another shape, or a dtype the parameter is not loaded from;
- in a flattened bucket (load_format "flattened_bucket"), a flattened tensor that is not a
  contiguous uint8 vector over a shared handle, and an entry whose byte range is not an aligned
  tensor of its shape and dtype inside it.

What the pickle builds along the way is not trusted either: loads() returns new views made from
the checked arguments as they were recorded, never an object the pickle may have altered since.
"""

from __future__ import annotations

import base64
import io
import math
import os
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlctl.engines.weightsync.ipc import ALLOWED, DTYPES, TAG_BYTES
from rlctl.engines.weightsync.ipc_handles import (
    REF_COUNTERS,
    SHM_HEADER,
    check_cuda_storage,
    check_int,
    local_gpu,
    map_shm,
    open_shm,
    refuse,
    shm_name,
)

if TYPE_CHECKING:
    import torch

MAX_DIMS = 16
CUDA_ARGS = 15
"""torch's rebuild_cuda_tensor arguments (reduce_tensor), SGLang's patched one's alike."""


class _Name:
    """An allowed class as a pickle may name it: an argument of a rebuild function, never called."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise refuse(
            f"{self.qualname} may be named in a weight pickle, not called: storages and tensors "
            "come from shared handles only"
        )


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > MAX_DIMS:
        raise refuse(f"{what} must be a tuple of at most {MAX_DIMS} integers, not {value!r}")
    return tuple(check_int(v, what) for v in value)


class _Opener:
    """One payload's rebuild functions, and what they made (the objects kept: ids stay unique)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.names: dict[str, _Name] = {}
        self.storages: dict[tuple, tuple[Any, int]] = {}
        """(kind, handle...) -> (storage, bytes) of each shared handle opened."""
        self.typed: dict[int, tuple[Any, Any, int, Any]] = {}
        """id(typed storage) -> (it, its storage, bytes, dtype)."""
        self.views: dict[int, tuple] = {}
        """id(tensor) -> (it, storage, bytes, dtype, offset, size, stride)."""
        self.metas: dict[int, tuple[_Name, tuple]] = {}
        """id(entry) -> (it, its checked fields) of each flattened bucket's metadata entry."""

    def resolve(self, module: str, name: str) -> Any:
        import torch

        if name in DTYPES:
            return getattr(torch, name)
        calls = {
            "Size": self.size,
            "rebuild_tensor": self.tensor,
            "rebuild_typed_storage": self.typed_storage,
            "rebuild_storage_filename": self.storage_filename,
            "rebuild_cuda_tensor": self.cuda_tensor,
            "_rebuild_cuda_tensor_modified": self.cuda_tensor,
            "FlattenedTensorMetadata": self.flat_meta,
        }
        return calls.get(name) or self.names.setdefault(name, _Name(f"{module}.{name}"))

    def _is(self, obj: Any, name: str) -> bool:
        return isinstance(obj, _Name) and self.names.get(name) is obj

    def _storage(self, obj: Any) -> tuple[Any, int]:
        for storage, nbytes in self.storages.values():
            if obj is storage:
                return storage, nbytes
        raise refuse("a storage that was not opened from a shared handle")

    @staticmethod
    def _dtype(dtype: Any) -> torch.dtype:
        import torch

        if not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") not in DTYPES:
            raise refuse(f"dtype {dtype!r} is not one a weight may have ({', '.join(DTYPES)})")
        return dtype

    def size(self, dims: Any) -> torch.Size:
        import torch

        return torch.Size(_dims(dims, "a torch.Size"))

    def storage_filename(self, cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
        if not self._is(cls, "UntypedStorage") or dtype is not None:
            raise refuse("rebuild_storage_filename takes torch.UntypedStorage and no dtype")
        if manager not in (b"", ""):
            raise refuse(
                f"the payload names the shared-memory manager {manager!r}: the built-in server "
                "connects to none (a payload of rlctl's sender names none)"
            )
        name = shm_name(handle)
        nbytes = check_int(size, "a shared-memory size", TAG_BYTES)
        opened = self.storages.get(("shm", name))
        if opened is None:
            opened = self.storages[("shm", name)] = (map_shm(name, nbytes, self.key), nbytes)
        elif opened[1] != nbytes:
            raise refuse(f"shared memory {name} is named with two sizes")
        return opened[0]

    def typed_storage(self, storage: Any, dtype: Any) -> Any:
        import torch

        storage, nbytes = self._storage(storage)
        dtype = self._dtype(dtype)
        typed = torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        self.typed[id(typed)] = (typed, storage, nbytes, dtype)
        return typed

    def tensor(self, cls: Any, storage: Any, metadata: Any) -> Any:
        made = self.typed.get(id(storage))
        if not self._is(cls, "Tensor") or made is None or made[0] is not storage:
            raise refuse("rebuild_tensor takes torch.Tensor and a storage opened from a shared handle")
        if not isinstance(metadata, tuple) or len(metadata) != 4:
            raise refuse("rebuild_tensor's metadata is (offset, size, stride, requires_grad)")
        offset, size, stride, _ = metadata
        return self.view(made[1], made[2], made[3], offset, size, stride)

    def cuda_tensor(self, *args: Any) -> Any:
        import torch

        if len(args) != CUDA_ARGS:
            raise refuse(f"rebuild_cuda_tensor takes {CUDA_ARGS} arguments, not {len(args)}")
        tensor_cls, size, stride, offset, storage_cls, dtype, device, handle = args[:8]
        nbytes, start, _, counters, counter, event, event_sync = args[8:]
        if not self._is(tensor_cls, "Tensor") or not (
            self._is(storage_cls, "TypedStorage") or self._is(storage_cls, "UntypedStorage")
        ):
            raise refuse("rebuild_cuda_tensor takes torch.Tensor and a torch storage class")
        dtype, index = self._dtype(dtype), local_gpu(device)
        if type(handle) is not bytes or not 0 < len(handle) <= 4096 or type(event) is not bytes or len(event) > 4096:
            raise refuse("a CUDA storage's handle and event handle are bytes")
        nbytes, start = check_int(nbytes, "a CUDA storage's size", TAG_BYTES), check_int(start, "a CUDA storage's offset")
        counter = check_int(counter, "a reference counter's offset", 0, REF_COUNTERS - 1)
        os.close(open_shm(shm_name(counters), SHM_HEADER + 8 * REF_COUNTERS))  # torch's counter file, or refused
        if type(event_sync) is not bool:
            raise refuse("event_sync_required is a bool")
        opened = self.storages.get(("cuda", handle, start))
        if opened is not None and opened[1] != nbytes:
            raise refuse("a CUDA storage is named with two sizes")
        if opened is not None:  # as torch does for a storage it holds already: give this reference back
            torch.UntypedStorage._release_ipc_counter(counters, counter, device=index)
        else:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                index, handle, nbytes, start, counters, counter, event, event_sync
            )
            check_cuda_storage(storage, nbytes, self.key)
            opened = self.storages[("cuda", handle, start)] = (storage, nbytes)
        return self.view(opened[0], nbytes, dtype, offset, size, stride)

    def flat_meta(self, name: Any, shape: Any, dtype: Any, start: Any, end: Any, numel: Any) -> Any:
        """SGLang's FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel): the
        bytes [start, end) of the bucket's flattened tensor are a `dtype` tensor of `shape`. The
        entry made is a token; loads() reads the checked fields recorded for it."""
        if type(name) is not str:
            raise refuse(f"a flattened bucket's tensor name must be a string, not {name!r}")
        shape, dtype = _dims(shape, f"{name}: a shape"), self._dtype(dtype)
        start, end, numel = (check_int(v, f"{name}: a byte offset") for v in (start, end, numel))
        if end - start != numel or numel != math.prod(shape) * dtype.itemsize or start % dtype.itemsize:
            raise refuse(f"{name}: bytes [{start}, {end}) ({numel} named) do not hold an aligned {dtype} tensor "
                          f"of shape {list(shape)}")
        entry = _Name("FlattenedTensorMetadata")
        self.metas[id(entry)] = (entry, (name, shape, dtype, start))
        return entry

    def view(self, storage: Any, nbytes: int, dtype: torch.dtype, offset: Any, size: Any, stride: Any) -> Any:
        """A tensor over `storage` if it stays within its `nbytes`."""
        import torch

        offset, size, stride = check_int(offset, "a tensor's offset"), _dims(size, "a size"), _dims(stride, "a stride")
        if len(size) != len(stride):
            raise refuse(f"a tensor of size {list(size)} has strides {list(stride)}")
        end = offset if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if end * dtype.itemsize > nbytes:
            raise refuse(
                f"a {dtype} tensor of size {list(size)}, strides {list(stride)} at offset {offset} reaches "
                f"{end * dtype.itemsize} bytes into a storage of {nbytes}"
            )
        t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
        self.views[id(t)] = (t, storage, nbytes, dtype, offset, size, stride)
        return t


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, opener: _Opener) -> None:
        super().__init__(io.BytesIO(data))
        self.opener = opener

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return self.opener.resolve(module, name)


def _fits(name: str, t: torch.Tensor, params: Mapping[str, torch.Tensor]) -> None:
    """Can the server load `t` into its parameter `name`? Same shape; the same dtype, or both
    floating point (a load casts, as SGLang's does)."""
    param = params.get(name)
    if param is None:
        raise refuse(f"unknown parameter name {name!r}")
    if tuple(t.shape) != tuple(param.shape):
        raise refuse(f"{name}: a tensor of shape {list(t.shape)} for the model's {list(param.shape)}")
    if t.dtype != param.dtype and not (t.dtype.is_floating_point and param.dtype.is_floating_point):
        raise refuse(f"{name}: a {t.dtype} tensor for the model's {param.dtype}")


def _flattened(bucket: Any, opener: _Opener) -> list[tuple[str, tuple]]:
    """A flattened bucket's tensors as (name, (storage, dtype, offset, size, stride)), each within
    the bucket's flattened tensor: a uint8 vector over a shared handle."""
    import torch

    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"} or not isinstance(
        bucket["metadata"], list
    ):
        raise refuse('a flattened bucket is {"flattened_tensor": tensor, "metadata": [FlattenedTensorMetadata, ...]}')
    made = opener.views.get(id(bucket["flattened_tensor"]))
    if made is None or made[0] is not bucket["flattened_tensor"]:
        raise refuse("flattened_tensor: not a tensor over a shared handle")
    _, storage, _, dtype, offset, size, stride = made
    if dtype != torch.uint8 or len(size) != 1 or stride != (1,):
        raise refuse(f"flattened_tensor must be a contiguous uint8 vector, not {dtype} of size {list(size)}")
    out = []
    for entry in bucket["metadata"]:
        recorded = opener.metas.get(id(entry))
        if recorded is None or recorded[0] is not entry:
            raise refuse("a flattened bucket's metadata entry that is not a FlattenedTensorMetadata")
        name, shape, kind, start = recorded[1]
        end = start + math.prod(shape) * kind.itemsize
        if end > size[0] or (offset + start) % kind.itemsize:
            raise refuse(f"{name}: bytes [{start}, {end}) of a flattened tensor of {size[0]}")
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        out.append((name, (storage, kind, (offset + start) // kind.itemsize, shape, strides)))
    return out


def loads(
    payload: str | bytes, *, key: bytes, params: Mapping[str, torch.Tensor] | None = None, flattened: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's payload as (name, tensor) pairs, views of the trainer's buffers mapped here,
    each checked against `params` (the server's model) when given. `key`: ipc.ipc_key of the
    run's token, which the buffers' tags must be made with. The payload is a list of (name,
    tensor) (ipc.dumps; load_format null), or with `flattened` one flattened bucket
    (ipc.dumps_bucket; load_format "flattened_bucket")."""
    import torch

    try:
        data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    except ValueError as e:
        raise refuse(f"serialized_named_tensors: not base64 ({e})") from None
    opener = _Opener(key)
    named = _Unpickler(data, opener).load()
    if flattened:
        out = []
        for name, (storage, dtype, offset, size, stride) in _flattened(named, opener):
            view = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
            if params is not None:
                _fits(name, view, params)
            out.append((name, view))
        return out
    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and type(p[0]) is str for p in named
    ):
        raise refuse("serialized_named_tensors must hold a list of (name, tensor) pairs")
    out = []
    for name, t in named:
        made = opener.views.get(id(t))
        if made is None or made[0] is not t:
            raise refuse(f"{name}: not a tensor over a shared handle")
        _, storage, _, dtype, offset, size, stride = made
        view = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
        if params is not None:
            _fits(name, view, params)
        out.append((name, view))
    return out
