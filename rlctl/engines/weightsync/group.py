"""The weight-sync process group, made exactly as SGLang makes it (docs/sglang.md).

A TCP rendezvous at tcp://master_address:master_port, the store wrapped in
PrefixStore(group_name), then a new process group of world_size on it. The trainer is rank 0 and
hosts the store; server i joins as rank_offset + tp_rank. Because both sides build the group the
same way, rlctl's sender works against real SGLang servers and SGLang-style senders work against
rlctl's built-in server. The store rank 0 hosts listens on master_address only (store.py), where
torch's own rendezvous would listen on every address of the host, and the sender ends it once the
group no longer needs it (seal_store, close_store).
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

    from rlctl.engines.weightsync.store import HostedStore, remember

    timeout = datetime.timedelta(seconds=timeout_s)
    hosted = None
    if rank == 0:  # the host of the store: on the master address only, a server the sender can end
        hosted = HostedStore(*_host_port(init_method), world_size, timeout)
        store = hosted.client
    else:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    try:
        pg, _ = _new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
        )
    except BaseException:
        if hosted is not None:
            hosted.close()
        raise
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    if hosted is not None:
        remember(pg, hosted)
    return pg


def seal_store(pg) -> None:
    """Every rank has joined: the store rank 0 hosts for `pg` takes no new connection."""
    from rlctl.engines.weightsync.store import hosted

    store = hosted(pg)
    if store is not None:
        store.seal()


def close_store(pg) -> None:
    """No rank needs the store of `pg` any more (store.py): rank 0 ends it and its port closes."""
    from rlctl.engines.weightsync.store import hosted

    store = hosted(pg)
    if store is not None:
        store.close()


def _host_port(init_method: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"{init_method!r} is not a tcp://HOST:PORT rendezvous")
    return url.hostname, url.port


def tcp_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta):
    """The store of a tcp://HOST:PORT rendezvous, as torch's rendezvous makes it, except that rank
    0 hosts it on HOST's address only: torch binds its store to every address of the host, so a
    socket bound here is handed to it (TCPStore's master_listen_fd). Other ranks connect."""
    import torch.distributed as dist

    from rlctl.process.auth import listening_socket

    host, port = _host_port(init_method)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    fd = listening_socket(host, port).detach()  # the store owns and closes it
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)


def destroy_process_group(pg) -> None:
    import torch.distributed as dist

    from rlctl.engines.weightsync.store import forget

    forget(pg)  # the store rank 0 hosted for it, if still open
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
