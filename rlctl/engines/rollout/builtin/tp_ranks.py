"""`--tp-size T` on the built-in server: the weight-update group sees T receiving ranks, as it
does for an SGLang server with tensor parallelism.

SGLang's TP worker r of a server joins the weight-update group as rank_offset + r and takes part
in every broadcast; each loads its shard of the received tensors. The built-in server generates
on one process (its rank 0, which holds the model); the T-1 others are processes of their own
here, each joining the group with its rank, receiving every bucket and keeping what it received
(whole tensors: there is no shard to cut), so that a test can check every rank's bytes.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any


def _rank_main(conn: Any, threads: int) -> None:
    """One extra TP rank: obey (command, arguments) from the server until it stops or goes away."""
    import torch

    from rlctl.engines.weightsync import (
        destroy_process_group,
        init_custom_process_group,
        receive_bucket,
        tensor_sha256,
    )

    torch.set_num_threads(threads)
    group = None
    received: dict[str, torch.Tensor] = {}
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        try:
            reply: Any = None
            if command == "join":
                group = init_custom_process_group(**args)
            elif command == "receive":
                received.update(receive_bucket(group, **args))
            elif command == "checksums":
                reply = {n: tensor_sha256(t) for n, t in received.items()}
            elif command == "destroy":
                destroy_process_group(group)
                group = None
            elif command == "stop":
                conn.send(("ok", None))
                return
            conn.send(("ok", reply))
        except Exception as e:  # noqa: BLE001 - reported to the server, which answers the sender
            conn.send(("error", f"{e.__class__.__name__}: {e}"))


class TpRanks:
    """The server's TP ranks 1 .. T-1, each a spawned process driven over a pipe."""

    def __init__(self, tp_size: int, threads: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        for r in range(1, tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child, threads), daemon=True, name=f"tp-rank-{r}")
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)

    def __len__(self) -> int:
        return len(self.procs)

    def _call_each(self, commands: list[tuple[str, dict]]) -> list[Any]:
        """Send rank r its command, then collect every reply (blocking: run it off the event loop)."""
        for pipe, command in zip(self.pipes, commands, strict=True):
            pipe.send(command)
        replies = [pipe.recv() for pipe in self.pipes]
        errors = [f"tp rank {r}: {msg}" for r, (status, msg) in enumerate(replies, start=1) if status != "ok"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [value for _, value in replies]

    def call(self, command: str, **args: Any) -> list[Any]:
        return self._call_each([(command, args)] * len(self.pipes))

    def join(self, *, rank_offset: int, **group: Any) -> None:
        """Rank r joins as rank_offset + r, as SGLang's TP worker r does."""
        self._call_each([("join", dict(group, rank=rank_offset + r)) for r in range(1, len(self.pipes) + 1)])

    def stop(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", {}))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
