"""The weight-sync process group, made exactly as SGLang makes it (docs/sglang.md).

A TCP rendezvous at tcp://master_address:master_port, the store wrapped in
PrefixStore(group_name), then a new process group of world_size on it. The trainer is rank 0 and
hosts the store; server i joins as rank_offset + tp_rank. Because both sides build the group the
same way, rlctl's sender works against real SGLang servers and SGLang-style senders work against
rlctl's built-in server. The store rank 0 hosts listens on master_address only (tcp_store), where
torch's own rendezvous would listen on every address of the host.
"""

from __future__ import annotations

import datetime

DEFAULT_GROUP_NAME = "weight_update_group"


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
):
    """Join a process group that is independent of any default group (SGLang's recipe)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:  # the host of the store: on the master address only
        store = tcp_store(init_method, rank, world_size, timeout)
    else:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def tcp_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta):
    """The store of a tcp://HOST:PORT rendezvous, as torch's rendezvous makes it, except that rank
    0 hosts it on HOST's address only: torch binds its store to every address of the host, so a
    socket bound here is handed to it (TCPStore's master_listen_fd). Other ranks connect."""
    from urllib.parse import urlsplit

    import torch.distributed as dist

    from rlctl.door import listening_socket

    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"{init_method!r} is not a tcp://HOST:PORT rendezvous")
    if rank != 0:
        return dist.TCPStore(url.hostname, url.port, world_size, False, timeout)
    fd = listening_socket(url.hostname, url.port).detach()  # the store owns and closes it
    return dist.TCPStore(url.hostname, url.port, world_size, True, timeout, master_listen_fd=fd)


def destroy_process_group(pg) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


def group_layout(tp_sizes: list[int]) -> tuple[int, list[int]]:
    """The weight-sync group for servers of these TP sizes: (world size, each server's rank_offset).

    The trainer is rank 0. SGLang's TP worker r of a server joins as rank_offset + r, so a server
    of TP t takes t ranks: with TP sizes t_0..t_{n-1} the world is 1 + sum(t_i) and server i's
    offset is 1 + t_0 + ... + t_{i-1}."""
    offsets, next_rank = [], 1
    for t in tp_sizes:
        if t < 1:
            raise ValueError(f"a server reports tp_size {t}")
        offsets.append(next_rank)
        next_rank += t
    return next_rank, offsets


def in_daemon_thread(fn, *args):
    """Run a blocking collective on a daemon thread; an asyncio future of its result.

    A collective whose peers never come (a server that refused the bucket) blocks until the
    group's timeout; on a daemon thread it cannot keep the process from exiting meanwhile."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop has closed: nobody waits for this broadcast any more

    threading.Thread(target=run, daemon=True, name="weight-broadcast").start()
    return fut
