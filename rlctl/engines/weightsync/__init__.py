"""The weight sync: trainer rank 0 sends Hugging Face-named tensors to every rollout server.

    group.py    the weight-sync process group, made as SGLang makes it (rendezvous, layout)
    store.py    the group's store on trainer rank 0, open only while the group forms
    buckets.py  how tensors are grouped, laid out on the wire and received; the sender's producer
    sender.py   WeightSender: one sync, streamed bucket by bucket (gloo, NCCL or IPC)
    ipc.py      tensors handed over in place to a server on the same GPU or host (CUDA IPC)
    ipc_open.py the built-in server's checked opening of such a payload

The names most callers need are importable from here.
"""

from rlctl.engines.weightsync.buckets import (
    TensorMeta,
    as_served,
    dtype_from_name,
    dtype_name,
    flatten_bucket,
    flattened_size,
    plan_buckets,
    receive_bucket,
    tensor_sha256,
    unflatten_bucket,
    wire_tensor,
)
from rlctl.engines.weightsync.group import (
    DEFAULT_GROUP_NAME,
    destroy_process_group,
    group_layout,
    in_daemon_thread,
    init_custom_process_group,
    tcp_store,
)
from rlctl.engines.weightsync.sender import BACKENDS, SyncStats, WeightSender, server_dtype

__all__ = [
    "BACKENDS", "DEFAULT_GROUP_NAME", "as_served", "SyncStats", "TensorMeta", "WeightSender", "destroy_process_group",
    "dtype_from_name", "dtype_name", "flatten_bucket", "flattened_size", "group_layout", "in_daemon_thread",
    "init_custom_process_group", "plan_buckets", "receive_bucket", "server_dtype", "tcp_store", "tensor_sha256",
    "unflatten_bucket", "wire_tensor",
]
