"""A model process gives its device memory back and takes it again, bit for bit.

A shared pool multiplexes several runs' models on one device: each model process must be able to
release what it holds there (weights, KV cache, optimizer state) and resume it later exactly as
it was. The bytes leave for host memory:

- from a CUDA device, into one pinned CPU tensor (copies at full PCIe speed both ways), kept for
  the next release: pinning gigabytes of host memory takes longer than copying them, so a model
  in a pool holds its released bytes' worth of host memory for the life of its process;
- from the CPU there is no other memory to go to, so they go to a file in a private directory
  (0700, the file 0600; PrivateDir) and the tensor is freed. The file is synced and dropped from
  the page cache, so the memory is the system's again until the resume reads it back.

The parts of a process (ModelWeights, Gradients, OptimizerState, or a part of its own) each
release and resume themselves; MemoryTags groups them under tags (SGLang's `weights`,
`kv_cache`, ... for a rollout server; `weights` and `optimizer` for a trainer) and moves them
together. Nothing here decides whether a release is allowed now (an idle server, no train step
running): the caller checks that, and refuses what needs a released part until it is resumed.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlctl.errors import RunError

if TYPE_CHECKING:
    import torch

    from rlctl.engines.weightsync.flat import FlatParams


class PrivateDir:
    """A directory only this user can enter, made on first use under `base` (the system's
    temporary directory when None) and removed by cleanup(). Its file names say what they hold
    (weights, optimizer), nothing more."""

    def __init__(self, base: str | None = None) -> None:
        self.base = base or None
        self.path: Path | None = None
        self.host: dict[str, torch.Tensor] = {}
        """name -> the host buffer its last release used (pinned where CUDA is), for the next."""

    def host_buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """nbytes of host memory for `name`'s bytes: the buffer its last release used when that is
        large enough, else a new one."""
        import torch

        buf = self.host.get(name)
        if buf is None or buf.numel() < nbytes:
            self.host.pop(name, None)  # freed before the larger one is pinned
            buf = self.host[name] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return buf[:nbytes]

    def new_file(self, name: str) -> int:
        """Create `name` in the directory, 0600, and return its descriptor (open for writing)."""
        if self.path is None:
            if self.base:
                Path(self.base).mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix="rlctl-offload-", dir=self.base))  # mode 0700
        (self.path / name).unlink(missing_ok=True)  # left by a release that failed half-way
        return os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def cleanup(self) -> None:
        self.host.clear()
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (0-d tensors included)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


@dataclass
class Stash:
    """Tensors' bytes held off their device, in order: in `host` (pinned memory) or in the file
    `path`. restore() gives new tensors with the same dtypes, shapes, devices and bytes."""

    metas: list[tuple[Any, tuple[int, ...], Any]]  # (dtype, shape, device) of each tensor
    sizes: list[int]
    host: Any = None
    path: Path | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @classmethod
    def take(cls, tensors: list[torch.Tensor], where: PrivateDir, name: str, to_file: bool | None = None) -> Stash:
        """Copy the tensors' bytes off their device: to a file when they are all on the CPU, else
        to host memory (`to_file` forces either). The caller frees the tensors afterwards."""

        tensors = [t.detach().contiguous() for t in tensors]
        stash = cls([(t.dtype, tuple(t.shape), t.device) for t in tensors], [t.numel() * t.element_size() for t in tensors])
        if not tensors:
            return stash
        if to_file if to_file is not None else all(t.device.type == "cpu" for t in tensors):
            fd = where.new_file(name)
            stash.path = where.path / name
            with os.fdopen(fd, "wb") as f:
                for t in tensors:
                    f.write(memoryview(_as_bytes(t).numpy()))
                f.flush()
                os.fsync(f.fileno())  # on disk, so the page cache may let the bytes go
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return stash
        stash.host = where.host_buffer(name, stash.nbytes)
        offset = 0
        for t, n in zip(tensors, stash.sizes, strict=True):
            stash.host[offset:offset + n].copy_(_as_bytes(t), non_blocking=True)
            offset += n
        _synchronize(tensors)  # every copy done before the caller frees the device memory
        return stash

    def restore(self, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """New tensors holding the stashed bytes (or `into`, tensors of the same sizes); the stash
        is spent (its file removed) once they all are, and kept when this fails (out of memory,
        say), so that it can be tried again."""
        import torch

        out = into if into is not None else [torch.empty(shape, dtype=dtype, device=device)
                                             for dtype, shape, device in self.metas]
        if self.path is not None:
            with open(self.path, "rb") as f:
                for t, n in zip(out, self.sizes, strict=True):
                    view = memoryview(_as_bytes(t).numpy())
                    got = 0
                    while got < n:
                        read = f.readinto(view[got:])
                        if not read:
                            raise RunError(f"{self.path}: ends after {got} of {n} bytes; the released memory is lost")
                        got += read
            self.discard()
            return out
        offset = 0
        for t, n in zip(out, self.sizes, strict=True):
            _as_bytes(t).copy_(self.host[offset:offset + n], non_blocking=True)
            offset += n
        _synchronize(out)  # before the host buffer is dropped
        self.discard()
        return out

    def discard(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        self.host = None


def _synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for the copies queued on each CUDA device among the tensors' (a copy runs on its
    device's stream; synchronize() alone would wait for this thread's current device only)."""
    import torch

    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def give_back(device: torch.device) -> None:
    """Return freed memory to the system: the CUDA caching allocator's cached device blocks and
    pinned host blocks (a resume's stash lands there), or on the CPU whatever the C allocator
    keeps (glibc keeps freed heap memory unless asked)."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.empty(0, dtype=t.dtype, device=t.device)


class Part(Protocol):
    """One piece of a process's memory that can leave its device and come back."""

    def nbytes(self) -> int: ...

    def release(self, where: PrivateDir) -> int: ...

    def resume(self) -> int: ...


class ModelWeights:
    """A module's parameters. With FlatParams (rlctl/engines/weightsync/flat.py) the one buffer
    they are views of is moved and every parameter is pointed at views of the new buffer, at the
    same spans, so weight syncs still land in place; otherwise each parameter is moved on its own.
    While released every parameter is an empty tensor: a forward pass fails on it, it does not
    read freed memory. Tied parameters are one Parameter object, so they stay tied."""

    def __init__(self, module, flat: FlatParams | None, name: str = "weights") -> None:
        self.flat = flat
        self.params = list({id(p): p for p in module.parameters()}.values())
        self.name = name
        self.stash: Stash | None = None
        self._bytes = flat.buffer.numel() if flat is not None else sum(p.numel() * p.element_size() for p in self.params)

    def nbytes(self) -> int:
        return self._bytes

    def release(self, where: PrivateDir) -> int:
        if self.flat is not None:
            self.stash = Stash.take([self.flat.buffer], where, self.name)
            self.flat.detach()
        else:
            self.stash = Stash.take([p.data for p in self.params], where, self.name)
            for p in self.params:
                p.data = _empty_like(p.data)
        return self.stash.nbytes

    def resume(self) -> int:
        if self.stash is None:
            return 0  # back already (a resume that failed on a later part is being tried again)
        tensors, stash, self.stash = self.stash.restore(), self.stash, None
        if self.flat is not None:
            self.flat.attach(tensors[0])
        else:
            for p, t in zip(self.params, tensors, strict=True):
                p.data = t
        return stash.nbytes


class Gradients:
    """The gradients a module's parameters hold now (those without one have none to move)."""

    def __init__(self, module, name: str = "gradients") -> None:
        self.params = list({id(p): p for p in module.parameters()}.values())
        self.name = name
        self.held: list = []
        self.stash: Stash | None = None

    def nbytes(self) -> int:
        if self.stash is not None:
            return self.stash.nbytes
        return sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)

    def release(self, where: PrivateDir) -> int:
        self.held = [p for p in self.params if p.grad is not None]
        self.stash = Stash.take([p.grad for p in self.held], where, self.name)
        for p in self.held:
            p.grad = None
        return self.stash.nbytes

    def resume(self) -> int:
        """After the parameters are back (a gradient must match its parameter's shape)."""
        if self.stash is None:
            return 0
        tensors, stash, self.stash = self.stash.restore(), self.stash, None
        for p, g in zip(self.held, tensors, strict=True):
            p.grad = g
        self.held = []
        return stash.nbytes


class OptimizerState:
    """Every tensor in a torch optimizer's per-parameter state (Adam's moments and step counts).
    While released each is an empty tensor of its dtype and device: a step would fail on it."""

    def __init__(self, optimizer, name: str = "optimizer") -> None:
        self.optimizer = optimizer
        self.name = name
        self.keys: list[tuple[Any, str]] = []
        self.stash: Stash | None = None

    def _tensors(self) -> list[tuple[Any, str]]:
        import torch

        return [(p, k) for p, state in self.optimizer.state.items() for k, v in state.items() if torch.is_tensor(v)]

    def nbytes(self) -> int:
        if self.stash is not None:
            return self.stash.nbytes
        state = self.optimizer.state
        return sum(state[p][k].numel() * state[p][k].element_size() for p, k in self._tensors())

    def release(self, where: PrivateDir) -> int:
        state = self.optimizer.state
        self.keys = self._tensors()
        self.stash = Stash.take([state[p][k] for p, k in self.keys], where, self.name)
        for p, k in self.keys:
            state[p][k] = _empty_like(state[p][k])
        return self.stash.nbytes

    def resume(self) -> int:
        if self.stash is None:
            return 0
        tensors, stash, self.stash = self.stash.restore(), self.stash, None
        for (p, k), t in zip(self.keys, tensors, strict=True):
            self.optimizer.state[p][k] = t
        self.keys = []
        return stash.nbytes


@dataclass
class Moved:
    tags: list[str]
    bytes: int
    seconds: float


class MemoryTags:
    """Parts under tags. A tag's parts are released in the order given and resumed in reverse
    (parameters before their gradients). release() and resume() move only the tags that are not
    already where they are asked to go, and report what moved."""

    def __init__(self, tags: dict[str, list[Part]], device: torch.device, offload_dir: str | None = None) -> None:
        self.tags = tags
        self.device = device
        self.where = PrivateDir(offload_dir)
        self.released: set[str] = set()

    def select(self, tags: list[str] | None) -> list[str]:
        """The tags asked for, in this object's order (None or [] = all); ValueError naming an unknown one."""
        if not tags:
            return list(self.tags)
        unknown = [t for t in tags if t not in self.tags]
        if unknown:
            raise ValueError(f"unknown memory tag {unknown[0]!r}; the tags are {', '.join(self.tags)}")
        return [t for t in self.tags if t in tags]

    def resident(self) -> dict[str, bool]:
        return {t: t not in self.released for t in self.tags}

    def nbytes(self, tag: str) -> int:
        return sum(part.nbytes() for part in self.tags[tag])

    def release(self, tags: list[str] | None) -> Moved:
        start, moved, total = time.monotonic(), [], 0
        for tag in self.select(tags):
            if tag in self.released:
                continue
            done: list[Part] = []
            try:
                for part in self.tags[tag]:
                    total += part.release(self.where)
                    done.append(part)
            except BaseException:  # a tag moves whole or not at all: put back what had left
                for part in reversed(done):
                    part.resume()
                raise
            self.released.add(tag)
            moved.append(tag)
        give_back(self.device)
        return Moved(moved, total, time.monotonic() - start)

    def resume(self, tags: list[str] | None) -> Moved:
        start, moved, total = time.monotonic(), [], 0
        for tag in self.select(tags):
            if tag not in self.released:
                continue
            total += sum(part.resume() for part in reversed(self.tags[tag]))  # parts already back give 0
            self.released.discard(tag)
            moved.append(tag)
        if moved and self.device.type == "cuda":
            give_back(self.device)  # the stashes' pinned host memory
        return Moved(moved, total, time.monotonic() - start)

    def cleanup(self) -> None:
        self.where.cleanup()
