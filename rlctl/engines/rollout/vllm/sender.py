"""Trainer rank 0's side of a weight sync to vLLM servers (or built-in servers emulating vLLM).

The same pipeline as WeightSender (buckets read lazily, packed while the previous one is on the
wire), with vLLM's calls around it, in the order of vLLM's own trainer engine
(NCCLTrainerWeightTransferEngine.send_weights):

    /pause?mode=abort -> /start_weight_update -> per bucket: /update_weights {names, dtype_names,
    shapes} to every server while the bucket is broadcast -> /finish_weight_update
    {weight_version} -> /resume

Joining: every server is sent /init_weight_transfer_engine {init_info} while the trainer joins the
group itself (group.TransferGroup), since both sides meet inside the rendezvous. Each bucket
is one packed chunk (group.packed_chunks with the group's buffer size = the bucket size):
its tensors' bytes back to back, no padding, in one uint8 broadcast.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from rlctl.engines.weightsync.buckets import Bucket
from rlctl.engines.weightsync.sender import CLOSE_TIMEOUT_S, WeightSender, server_dtype
from rlctl.engines.rollout.vllm.group import TransferGroup, init_info, packed_chunks
from rlctl.errors import RunError
from rlctl.process.auth import address_for_peers


class VllmWeightSender(WeightSender):
    """`server`: what the servers hold their weights as ({"dtype", "model_path"}, as /server_info
    would say; vLLM has no such route), so that wider weights are cast before they leave."""

    def __init__(self, clients: list, *, server: dict[str, Any] | None = None, device: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(clients, flattened=True, **kwargs)
        self.device = device
        """The trainer's device; for NCCL, the GPU the group is formed on (vLLM's trainer_init uses the current one)."""
        if self.backend == "ipc":
            raise RunError("vLLM servers receive weights over NCCL (gloo when emulated), not ipc")
        self.server = server or {}

    async def connect(self) -> None:
        """Check every server's release, learn how many ranks each takes, and form the group."""
        from rlctl.engines.rollout.vllm.launch import check_version
        from rlctl.engines.weightsync.buckets import dtype_from_name

        for c in self.clients:
            check_version(await c.version())
        self.tp_sizes = list(await asyncio.gather(*(c.world_size() for c in self.clients)))
        held = server_dtype(self.server) if self.server else None
        self.server_dtype = dtype_from_name(held) if held else None
        # vLLM's store binds master_address itself: a name this node resolves to loopback only
        # would shut out servers on other nodes (rlctl/process/auth.py address_for_peers).
        self.master_address = address_for_peers(self.master_address, [urlsplit(c.url).hostname for c in self.clients])
        await self._join()
        self.session_needed = [True] * len(self.clients)

    async def _ask_to_join(self, client, rank_offset: int) -> None:
        await client.init_weight_transfer_engine(init_info(
            master_address=self.master_address, master_port=self.master_port, rank_offset=rank_offset,
            world_size=self.world_size, buffer_bytes=self.bucket_bytes))

    def _join_group(self) -> TransferGroup:
        return TransferGroup.join(self.backend, master_address=self.master_address, master_port=self.master_port,
                                  rank=0, world_size=self.world_size, device=self.device)

    def _formed(self) -> None:
        """Every server has joined, and vLLM's communicator is made as the group forms (gloo's
        process group likewise): the store is sealed and closed at once (vllm_group.py)."""
        self.group.seal_store()
        self.group.close_store()

    def _close_store(self) -> None:
        if self.group is not None:
            self.group.close_store()

    async def _begin(self, everyone: list, in_session: list, pause_mode: str) -> None:
        await asyncio.gather(*(c.pause_generation(pause_mode) for c in everyone))
        await asyncio.gather(*(c.start_weight_update() for c in everyone))

    async def _finish(self, everyone: list, in_session: list, version: str, buckets: int) -> None:
        await asyncio.gather(*(c.finish_weight_update(version) for c in everyone))
        await asyncio.gather(*(c.continue_generation() for c in everyone))

    async def _send_bucket(self, bucket: Bucket, version: str | None) -> None:
        sizes = [m.nbytes for m in bucket.metas]
        if len(packed_chunks(sizes, self.bucket_bytes)) != 1:  # plan_buckets keeps a bucket within its size
            raise RunError(f"a bucket of {sum(sizes)} bytes would be cut into several of vLLM's chunks of "
                           f"{self.bucket_bytes} bytes")
        await super()._send_bucket(bucket, None)

    async def _announce(self, client, bucket: Bucket, version: str | None) -> None:
        await client.update_weights(names=[m.name for m in bucket.metas], dtype_names=[m.dtype for m in bucket.metas],
                                    shapes=[list(m.shape) for m in bucket.metas])

    def _broadcast(self, tensors: list) -> None:
        import torch

        for t in tensors:
            if t.is_cuda:
                torch.cuda.set_device(t.device)
            self.group.broadcast(t)

    async def close(self) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        shutdowns = asyncio.gather(*(c.shutdown_weight_transfer_engine() for c in self.clients), return_exceptions=True)
        try:
            await asyncio.wait_for(shutdowns, CLOSE_TIMEOUT_S)
        except TimeoutError:
            pass
        if not self.broken:
            group.close()
