"""The built-in server's side of /update_weights_from_tensor: a weight pickle opened with checks.

A pickle from the network names what its receiver calls. SGLang's SafeUnpickler lets it name
torch's rebuild functions, which then map whatever shared memory, CUDA allocation or manager
socket the pickle names (docs/security.md). Here every allowed function name (ipc.ALLOWED)
resolves to a method of _Opener that checks its arguments before torch sees them, every allowed
class to a _Name that cannot be called, and no other name resolves. Refused, before anything is
mapped, created or connected:

- a storage that is not a shared handle: nothing in a payload makes a fresh storage or tensor,
  whose bytes would be whatever the allocator last held there;
- shared memory that is not one of the trainer's buffers: a CPU handle must name a file of
  torch's pattern in /dev/shm, of this user, of exactly the size named (torch's header
  included), that ends in the run's tag (ipc.py). It is mapped read-only and private, and never
  grown, written or unlinked; a payload that names a manager socket is refused (none is used);
- a CUDA storage that reaches past its allocation or does not end in the tag, and a
  reference-counter file that is not torch's (pattern, owner, size) or an offset outside it;
- a tensor that reaches past its storage (offset plus the extent of its size and strides times
  the element size), a dtype outside ipc.DTYPES, and, against the server's model, an unknown
  name, another shape, or a dtype the parameter is not loaded from.

What the pickle builds along the way is not trusted either: loads() returns new views made from
the checked arguments as they were recorded, never an object the pickle may have altered since.
"""

from __future__ import annotations

import base64
import hmac
import io
import mmap
import os
import pickle
import re
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlctl.engines.weightsync.ipc import ALLOWED, DTYPES, TAG_BYTES, gpu_uuid, tag_for

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
SHM_HEADER = 64
"""torch's RefcountedMapAllocator keeps its reference count in front of a file's data."""
SHM_NAME = re.compile(r"/torch_\d{1,10}_\d{1,20}_\d{1,20}")
"""The names torch gives its shared-memory files (NewProcessWideShmHandle)."""
REF_COUNTERS = 10000
"""torch::CUDA_IPC_REF_COUNTER_FILE_SIZE: the int64 counters of a CUDA producer's counter file."""
MAX_BYTES = 1 << 40
MAX_DIMS = 16
CUDA_ARGS = 15
"""torch's rebuild_cuda_tensor arguments (reduce_tensor), SGLang's patched one's alike."""


class Refused(ValueError):
    """A payload the server does not open; the message says why."""


def _refuse(message: str) -> Refused:
    return Refused(message[:300])


class _Name:
    """An allowed class as a pickle may name it: an argument of a rebuild function, never called."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(
            f"{self.qualname} may be named in a weight pickle, not called: storages and tensors "
            "come from shared handles only"
        )


def _int(value: Any, what: str, low: int = 0, high: int = MAX_BYTES) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _refuse(f"{what} must be an integer in [{low}, {high}], not {value!r}")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > MAX_DIMS:
        raise _refuse(f"{what} must be a tuple of at most {MAX_DIMS} integers, not {value!r}")
    return tuple(_int(v, what) for v in value)


def _shm_name(handle: Any) -> str:
    name = handle.decode("ascii", "replace") if isinstance(handle, bytes) else handle
    if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
        raise _refuse(f"{handle!r} is not the name of one of torch's shared-memory files")
    return name


def _open_shm(name: str, file_bytes: int) -> int:
    """A read-only descriptor of /dev/shm/NAME if it is a file of this user of exactly
    `file_bytes`: nothing is created, truncated or grown."""
    try:
        fd = os.open(SHM_DIR + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _refuse(f"shared memory {name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise _refuse(f"shared memory {name} is not a file of this server's user")
        if st.st_size != file_bytes:
            raise _refuse(
                f"shared memory {name} holds {st.st_size - SHM_HEADER} bytes, not the {file_bytes - SHM_HEADER} named"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_shm(name: str, nbytes: int, key: bytes) -> torch.UntypedStorage:
    """The storage of one of the trainer's CPU buffers, mapped private and read-only at the file
    (a write here never reaches it), if the file ends in the run's tag."""
    import torch

    fd = _open_shm(name, SHM_HEADER + nbytes)
    try:
        mapped = mmap.mmap(fd, SHM_HEADER + nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    end = SHM_HEADER + nbytes
    if not hmac.compare_digest(mapped[end - TAG_BYTES : end], tag_for(key, nbytes)):
        mapped.close()
        raise _refuse(f"shared memory {name} is not a buffer of this run's trainer (it does not end in the run's tag)")
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=SHM_HEADER).untyped_storage()


def local_gpu(device: Any) -> int:
    """The index here of a GPU given as an index or UUID (what SGLang's patched pickles carry)."""
    import torch

    if type(device) is int:
        return _int(device, "a GPU index", 0, max(torch.cuda.device_count() - 1, 0))
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if gpu_uuid(index) == device:
                return index
    raise ValueError(
        f"the weights are on GPU {device!r}, which this process does not see: "
        "CUDA IPC needs sender and server on one GPU (use sync_backend nccl or gloo)"
    )


def _allocation(ptr: int) -> tuple[int, int]:
    """(start, bytes) of the CUDA allocation that holds device address `ptr` (the driver's)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise _refuse(f"cannot check a CUDA storage's bounds: {e}") from None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise _refuse(f"cannot check a CUDA storage's bounds (cuMemGetAddressRange: error {rc})")
    return base.value, size.value


def _check_cuda_storage(storage: torch.UntypedStorage, nbytes: int, key: bytes) -> None:
    import torch

    start, size = _allocation(storage.data_ptr())
    if storage.data_ptr() + nbytes > start + size:
        raise _refuse(
            f"a CUDA storage of {nbytes} bytes at byte {storage.data_ptr() - start} of its allocation "
            f"reaches past its end ({size} bytes)"
        )
    tail = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, nbytes - TAG_BYTES, (TAG_BYTES,))
    if not hmac.compare_digest(bytes(tail.cpu().tolist()), tag_for(key, nbytes)):
        raise _refuse("a CUDA storage that is not a buffer of this run's trainer (it does not end in the run's tag)")


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
        }
        return calls.get(name) or self.names.setdefault(name, _Name(f"{module}.{name}"))

    def _is(self, obj: Any, name: str) -> bool:
        return isinstance(obj, _Name) and self.names.get(name) is obj

    def _storage(self, obj: Any) -> tuple[Any, int]:
        for storage, nbytes in self.storages.values():
            if obj is storage:
                return storage, nbytes
        raise _refuse("a storage that was not opened from a shared handle")

    @staticmethod
    def _dtype(dtype: Any) -> torch.dtype:
        import torch

        if not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") not in DTYPES:
            raise _refuse(f"dtype {dtype!r} is not one a weight may have ({', '.join(DTYPES)})")
        return dtype

    def size(self, dims: Any) -> torch.Size:
        import torch

        return torch.Size(_dims(dims, "a torch.Size"))

    def storage_filename(self, cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
        if not self._is(cls, "UntypedStorage") or dtype is not None:
            raise _refuse("rebuild_storage_filename takes torch.UntypedStorage and no dtype")
        if manager not in (b"", ""):
            raise _refuse(
                f"the payload names the shared-memory manager {manager!r}: the built-in server "
                "connects to none (a payload of rlctl's sender names none)"
            )
        name = _shm_name(handle)
        nbytes = _int(size, "a shared-memory size", TAG_BYTES)
        opened = self.storages.get(("shm", name))
        if opened is None:
            opened = self.storages[("shm", name)] = (map_shm(name, nbytes, self.key), nbytes)
        elif opened[1] != nbytes:
            raise _refuse(f"shared memory {name} is named with two sizes")
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
            raise _refuse("rebuild_tensor takes torch.Tensor and a storage opened from a shared handle")
        if not isinstance(metadata, tuple) or len(metadata) != 4:
            raise _refuse("rebuild_tensor's metadata is (offset, size, stride, requires_grad)")
        offset, size, stride, _ = metadata
        return self.view(made[1], made[2], made[3], offset, size, stride)

    def cuda_tensor(self, *args: Any) -> Any:
        import torch

        if len(args) != CUDA_ARGS:
            raise _refuse(f"rebuild_cuda_tensor takes {CUDA_ARGS} arguments, not {len(args)}")
        tensor_cls, size, stride, offset, storage_cls, dtype, device, handle = args[:8]
        nbytes, start, _, counters, counter, event, event_sync = args[8:]
        if not self._is(tensor_cls, "Tensor") or not (
            self._is(storage_cls, "TypedStorage") or self._is(storage_cls, "UntypedStorage")
        ):
            raise _refuse("rebuild_cuda_tensor takes torch.Tensor and a torch storage class")
        dtype, index = self._dtype(dtype), local_gpu(device)
        if type(handle) is not bytes or not 0 < len(handle) <= 4096 or type(event) is not bytes or len(event) > 4096:
            raise _refuse("a CUDA storage's handle and event handle are bytes")
        nbytes, start = _int(nbytes, "a CUDA storage's size", TAG_BYTES), _int(start, "a CUDA storage's offset")
        counter = _int(counter, "a reference counter's offset", 0, REF_COUNTERS - 1)
        os.close(_open_shm(_shm_name(counters), SHM_HEADER + 8 * REF_COUNTERS))  # torch's counter file, or refused
        if type(event_sync) is not bool:
            raise _refuse("event_sync_required is a bool")
        opened = self.storages.get(("cuda", handle, start))
        if opened is not None and opened[1] != nbytes:
            raise _refuse("a CUDA storage is named with two sizes")
        if opened is not None:  # as torch does for a storage it holds already: give this reference back
            torch.UntypedStorage._release_ipc_counter(counters, counter, device=index)
        else:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                index, handle, nbytes, start, counters, counter, event, event_sync
            )
            _check_cuda_storage(storage, nbytes, self.key)
            opened = self.storages[("cuda", handle, start)] = (storage, nbytes)
        return self.view(opened[0], nbytes, dtype, offset, size, stride)

    def view(self, storage: Any, nbytes: int, dtype: torch.dtype, offset: Any, size: Any, stride: Any) -> Any:
        """A tensor over `storage` if it stays within its `nbytes`."""
        import torch

        offset, size, stride = _int(offset, "a tensor's offset"), _dims(size, "a size"), _dims(stride, "a stride")
        if len(size) != len(stride):
            raise _refuse(f"a tensor of size {list(size)} has strides {list(stride)}")
        end = offset if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if end * dtype.itemsize > nbytes:
            raise _refuse(
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
        raise _refuse(f"unknown parameter name {name!r}")
    if tuple(t.shape) != tuple(param.shape):
        raise _refuse(f"{name}: a tensor of shape {list(t.shape)} for the model's {list(param.shape)}")
    if t.dtype != param.dtype and not (t.dtype.is_floating_point and param.dtype.is_floating_point):
        raise _refuse(f"{name}: a {t.dtype} tensor for the model's {param.dtype}")


def loads(
    payload: str | bytes, *, key: bytes, params: Mapping[str, torch.Tensor] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's payload (ipc.dumps) as (name, tensor) pairs, views of the trainer's buffers
    mapped here, each checked against `params` (the server's model) when given. `key`:
    ipc.ipc_key of the run's token, which the buffers' tags must be made with."""
    import torch

    try:
        data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    except ValueError as e:
        raise _refuse(f"serialized_named_tensors: not base64 ({e})") from None
    opener = _Opener(key)
    named = _Unpickler(data, opener).load()
    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and type(p[0]) is str for p in named
    ):
        raise _refuse("serialized_named_tensors must hold a list of (name, tensor) pairs")
    out = []
    for name, t in named:
        made = opener.views.get(id(t))
        if made is None or made[0] is not t:
            raise _refuse(f"{name}: not a tensor over a shared handle")
        _, storage, _, dtype, offset, size, stride = made
        view = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
        if params is not None:
            _fits(name, view, params)
        out.append((name, view))
    return out
