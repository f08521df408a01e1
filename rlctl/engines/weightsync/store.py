"""The store trainer rank 0 hosts while a weight-sync group forms, open no longer than that.

A torch TCPStore has no credential: whoever reaches its port may set keys of any size in the
trainer's memory. The group needs it only while it forms: gloo's rendezvous is done when every
rank's process group exists, and NCCL's only at its first collective (torch creates the
communicator then, through the store). So rank 0's store is a server of its own (HostedStore),
apart from the client connection its process group holds, and the sender ends it in two steps:

    seal()   once every rank has joined: the listening socket drops every new connection (a
             socket filter that refuses every packet: the ranks' connections, already made, go
             on; a new one gets no answer);
    close()  once no rank needs the store (gloo: at once; NCCL: after the first broadcast): the
             server is dropped, its port closed.

Closing the listening socket under a live TCPStore instead does not work: torch's libuv server
then spins on the failing accept, its older server ends the process. tests/test_weight_store.py
shows a group that broadcasts after its store is sealed and closed, and a client that cannot
reach it.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import socket
import struct
from typing import Any

log = logging.getLogger("rlctl.weightsync")

_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux's value where Python does not name it
_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)  # classic BPF: BPF_RET | BPF_K, 0 = keep no byte of any packet


class HostedStore:
    """The store of a tcp://HOST:PORT rendezvous, served by rank 0 on HOST's address only
    (rlctl/process/auth.py listening_socket, handed to TCPStore); `client` is what the process group uses."""

    def __init__(self, host: str, port: int, world_size: int, timeout: datetime.timedelta) -> None:
        import torch.distributed as dist

        from rlctl.process.auth import listening_socket

        sock = listening_socket(host, port)
        self._listener: socket.socket | None = socket.socket(fileno=os.dup(sock.fileno()))  # to seal it later
        try:
            self._server: Any = dist.TCPStore(
                host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach()
            )  # the server owns and closes it
            self.client: Any = dist.TCPStore(host, port, world_size, False, timeout)
        except BaseException:
            self._listener.close()
            raise
        self.host, self.port = host, port

    @property
    def closed(self) -> bool:
        return self._server is None

    def seal(self) -> None:
        """No new connection from now on; the ones made go on."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        try:
            program = ctypes.create_string_buffer(_DROP_ALL)
            listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, struct.pack("HL", 1, ctypes.addressof(program)))
        except OSError as e:  # not Linux: the store stays open until close()
            log.warning(
                "the weight-sync store on %s:%d cannot be sealed (%s); it stays open until the "
                "group no longer needs it",
                self.host,
                self.port,
                e,
            )
        finally:
            listener.close()  # our duplicate only: the server's socket listens on, filtered

    def close(self) -> None:
        """The server ends and its port closes; the process group's client connection is left
        without a server, which neither gloo nor NCCL asks anything of once their groups are formed."""
        self.seal()
        self._server = None


_hosted: dict[int, HostedStore] = {}
"""id(process group) -> the store its rank 0 hosts, until the group is destroyed."""


def remember(group: Any, store: HostedStore) -> None:
    _hosted[id(group)] = store


def hosted(group: Any) -> HostedStore | None:
    return _hosted.get(id(group))


def forget(group: Any) -> None:
    store = _hosted.pop(id(group), None)
    if store is not None:
        store.close()
