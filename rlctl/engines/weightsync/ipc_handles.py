"""Shared handles as the built-in server opens them: what is checked before, and right after, a
storage named in a weight pickle is mapped (ipc_open.py calls these).

- A CPU handle must name one of torch's shared-memory files in /dev/shm, of this user, of exactly
  the size named (torch's header included), that ends in the run's tag (ipc.py). It is mapped
  read-only and private, and never grown, written or unlinked.
- A CUDA handle opens only on a GPU this process sees (named by index or UUID), and its storage
  must lie within its allocation (the driver's address range) and end in the run's tag.
"""

from __future__ import annotations

import hmac
import mmap
import os
import re
import stat
from typing import TYPE_CHECKING, Any

from rlctl.engines.weightsync.ipc import TAG_BYTES, gpu_uuid, tag_for

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

class Refused(ValueError):
    """A payload the server does not open; the message says why."""


def refuse(message: str) -> Refused:
    return Refused(message[:300])


def check_int(value: Any, what: str, low: int = 0, high: int = MAX_BYTES) -> int:
    if type(value) is not int or not low <= value <= high:
        raise refuse(f"{what} must be an integer in [{low}, {high}], not {value!r}")
    return value


def shm_name(handle: Any) -> str:
    name = handle.decode("ascii", "replace") if isinstance(handle, bytes) else handle
    if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
        raise refuse(f"{handle!r} is not the name of one of torch's shared-memory files")
    return name


def open_shm(name: str, file_bytes: int) -> int:
    """A read-only descriptor of /dev/shm/NAME if it is a file of this user of exactly
    `file_bytes`: nothing is created, truncated or grown."""
    try:
        fd = os.open(SHM_DIR + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise refuse(f"shared memory {name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise refuse(f"shared memory {name} is not a file of this server's user")
        if st.st_size != file_bytes:
            raise refuse(
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

    fd = open_shm(name, SHM_HEADER + nbytes)
    try:
        mapped = mmap.mmap(fd, SHM_HEADER + nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    end = SHM_HEADER + nbytes
    if not hmac.compare_digest(mapped[end - TAG_BYTES : end], tag_for(key, nbytes)):
        mapped.close()
        raise refuse(f"shared memory {name} is not a buffer of this run's trainer (it does not end in the run's tag)")
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=SHM_HEADER).untyped_storage()


def local_gpu(device: Any) -> int:
    """The index here of a GPU given as an index or UUID (what SGLang's patched pickles carry)."""
    import torch

    if type(device) is int:
        return check_int(device, "a GPU index", 0, max(torch.cuda.device_count() - 1, 0))
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if gpu_uuid(index) == device:
                return index
    raise ValueError(
        f"the weights are on GPU {device!r}, which this process does not see: "
        "CUDA IPC needs sender and server on one GPU (use sync_backend nccl or gloo)"
    )


def allocation(ptr: int) -> tuple[int, int]:
    """(start, bytes) of the CUDA allocation that holds device address `ptr` (the driver's)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise refuse(f"cannot check a CUDA storage's bounds: {e}") from None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise refuse(f"cannot check a CUDA storage's bounds (cuMemGetAddressRange: error {rc})")
    return base.value, size.value


def check_cuda_storage(storage: torch.UntypedStorage, nbytes: int, key: bytes) -> None:
    import torch

    start, size = allocation(storage.data_ptr())
    if storage.data_ptr() + nbytes > start + size:
        raise refuse(
            f"a CUDA storage of {nbytes} bytes at byte {storage.data_ptr() - start} of its allocation "
            f"reaches past its end ({size} bytes)"
        )
    tail = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, nbytes - TAG_BYTES, (TAG_BYTES,))
    if not hmac.compare_digest(bytes(tail.cpu().tolist()), tag_for(key, nbytes)):
        raise refuse("a CUDA storage that is not a buffer of this run's trainer (it does not end in the run's tag)")
