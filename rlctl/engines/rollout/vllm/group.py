"""vLLM's weight-transfer group, formed on the trainer's side as vLLM's own trainer helper forms it.

vLLM's NCCL backend (vllm/distributed/weight_transfer/nccl_common.py, 0.33.0 and 0.34.0) does not
join a torch.distributed group. Every rank creates a `StatelessProcessGroup`: a TCPStore at
master_address:master_port, hosted by rank 0 (the trainer) for `world_size` clients, with no
prefix; over it rank 0 publishes NCCL's unique id (`broadcast_obj`, key "broadcast_from/0/0") and
every rank builds a PyNcclCommunicator. Server worker w of a server with rank_offset o joins as
o + dp_rank * (TP x PP) + rank_in_dp, so servers of world sizes n_0..n_k take ranks 1.. in turn,
as SGLang's TP ranks do (group.group_layout).

Two data planes:
- nccl: the real thing. The trainer calls vLLM's own trainer_init (so vLLM must be importable
  on trainer rank 0: a missing vLLM stops the run before it starts) and broadcasts from GPU memory.
- gloo: rlctl's built-in server emulating vLLM on the CPU (rollout.builtin.emulate_vllm). Same
  store, same ranks, same key protocol (StoreGroup below); the bytes go over a gloo group on the
  store (prefix GLOO_PREFIX) where vLLM would build NCCL.

Buckets travel "packed" (vLLM's packed_tensor.py): each /update_weights call's tensors are cut
into chunks by packed_chunks(), each chunk one uint8 broadcast of the tensors' bytes back to back.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

from rlctl.engines.weightsync.group import group_layout

__all__ = ["GLOO_PREFIX", "INIT_INFO_KEYS", "StoreGroup", "TransferGroup", "group_layout", "init_info",
           "packed_chunks"]

INIT_INFO_KEYS = ("master_address", "master_port", "rank_offset", "world_size", "packed",
                  "packed_buffer_size_bytes", "packed_num_buffers")
"""What /init_weight_transfer_engine's init_info carries (NCCLWeightTransferInitInfo's fields rlctl sets)."""
PACKED_NUM_BUFFERS = 2
"""vLLM's default; the receiver double-buffers chunks, which changes nothing on the wire."""
GLOO_PREFIX = "rlctl-gloo/"
STORE_TIMEOUT_S = 300.0


def init_info(*, master_address: str, master_port: int, rank_offset: int, world_size: int,
              buffer_bytes: int) -> dict[str, Any]:
    """One server's init_info: packed transfer, chunks of `buffer_bytes` (packed_chunks)."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "packed": True, "packed_buffer_size_bytes": int(buffer_bytes),
            "packed_num_buffers": PACKED_NUM_BUFFERS}


def packed_chunks(sizes: list[int], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors of each chunk, as vLLM cuts them (pack_tensors on the trainer,
    packed_nccl_broadcast_consumer on the workers): tensors are added in order, and a chunk ends
    right after the tensor that takes it past buffer_bytes. A chunk of at most buffer_bytes, or a
    single tensor larger than that, is one chunk."""
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total > buffer_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


class StoreGroup:
    """The metadata part of vLLM's StatelessProcessGroup: a TCPStore and broadcast_obj's keys.
    Rank 0 hosts the store on master_address only (store.HostedStore: a socket bound there,
    handed to TCPStore, as vLLM's create() does), and ends it once the group is formed (close).

    The values are pickles, as vLLM's are; what is read back is unpickled with no global at all
    (plain_loads): a key someone else set in the store gives data, never a call."""

    def __init__(self, store: Any, rank: int, world_size: int, hosted: Any = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.hosted = hosted
        self.sent = 0
        self.received = [0] * world_size

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int,
               timeout_s: float = STORE_TIMEOUT_S) -> StoreGroup:
        import torch.distributed as dist

        from rlctl.engines.weightsync.store import HostedStore

        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            hosted = HostedStore(host, port, world_size, timeout)
            return cls(hosted.client, rank, world_size, hosted)
        store = dist.TCPStore(host_name=host, port=port, world_size=world_size, is_master=False,
                              timeout=timeout, use_libuv=False)
        return cls(store, rank, world_size)

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            self.store.set(f"broadcast_from/{src}/{self.sent}", pickle.dumps(obj))
            self.sent += 1
            return obj
        key = f"broadcast_from/{src}/{self.received[src]}"
        self.received[src] += 1
        return plain_loads(self.store.get(key), key)

    def seal(self) -> None:
        """Every rank has joined: the store rank 0 hosts takes no new connection (store.py)."""
        if self.hosted is not None:
            self.hosted.seal()

    def close(self) -> None:
        """No rank reads the store any more: rank 0 ends it and its port closes."""
        if self.hosted is not None:
            self.hosted.close()


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a weight-transfer store value may hold plain data only, not {module}.{name}")


def plain_loads(data: bytes, key: str) -> Any:
    """A store value as vLLM pickles it (str, bytes, numbers, lists, dicts: what its
    broadcast_obj carries), with every global refused: nothing in it is called."""
    import io

    try:
        return _NoGlobals(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise ValueError(f"weight-transfer store key {key!r}: {e}") from None


class TransferGroup:
    """One rank's end of the group: `broadcast(tensor)` from rank 0 to every rank."""

    def __init__(self, backend: str, comm: Any, store: StoreGroup | None = None) -> None:
        self.backend, self.comm, self.store = backend, comm, store

    @classmethod
    def join(cls, backend: str, *, master_address: str, master_port: int, rank: int, world_size: int,
             timeout_s: float = STORE_TIMEOUT_S, device: str | None = None) -> TransferGroup:
        if backend == "nccl":
            if rank != 0:
                raise ValueError("only the trainer's end is rlctl's over NCCL; vLLM's workers join themselves")
            import torch
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            if device and device.startswith("cuda"):
                torch.cuda.set_device(torch.device(device))  # trainer_init forms the group on the current GPU

            return cls("nccl", trainer_init({"master_address": master_address, "master_port": master_port,
                                             "world_size": world_size}))
        if backend != "gloo":
            raise ValueError(f"vLLM's weight transfer goes over nccl (or gloo, emulated), not {backend!r}")
        import torch.distributed as dist

        store = StoreGroup.create(master_address, master_port, rank, world_size, timeout_s)
        try:
            said = store.broadcast_obj("gloo" if rank == 0 else None, src=0)  # where vLLM publishes NCCL's unique id
            if said != "gloo":
                raise ValueError(f"the weight-transfer group's rank 0 published {str(said)[:80]!r}, not 'gloo': "
                                 "this is not an rlctl trainer's emulated group")
            pg = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, store.store), rank, world_size,
                                       datetime.timedelta(seconds=timeout_s))
        except BaseException:
            store.close()
            raise
        return cls("gloo", pg, store)

    def broadcast(self, tensor: Any) -> None:
        if self.backend == "nccl":
            import torch

            self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
            return
        self.comm.broadcast(tensor, 0).wait()

    def seal_store(self) -> None:
        """Every rank has joined (the servers have answered): no new connection to the store."""
        if self.store is not None:
            self.store.seal()

    def close_store(self) -> None:
        """The group is formed and its store is needed no more: rank 0's is ended, its port
        closed. gloo's ranks connected when the process group was made; vLLM's communicator
        made NCCL's at once (and warmed it up with an all_reduce), so every rank has read the id.
        vLLM's own StatelessProcessGroup, the store's only holder, is dropped: vLLM leaves it
        None for a communicator made without one (PyNcclCommunicator.from_unique_id_bytes)."""
        if self.store is not None:
            self.store.close()
        if self.backend == "nccl" and getattr(self.comm, "group", None) is not None:
            self.comm.group = None

    def close(self) -> None:
        if self.backend == "nccl":
            destroy = getattr(self.comm, "destroy", None)
            if destroy is not None:
                destroy()
        self.close_store()
        self.comm = None
