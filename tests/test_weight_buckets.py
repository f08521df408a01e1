"""The sender's producer (rlctl/engines/weightsync/buckets.py): buckets made from a stream of
weights, read no further ahead than one tensor, packed into two reused buffers, cast for the wire."""

from __future__ import annotations

import torch

from rlctl.engines.weightsync import unflatten_bucket
from rlctl.engines.weightsync.buckets import BucketMaker, dtype_from_name


def stream(n: int, numel: int, pulled: list[int], dtype=torch.float32):
    for i in range(n):
        pulled[0] += 1
        yield f"w{i}", torch.full((numel,), float(i), dtype=dtype)


def test_buckets_are_read_one_tensor_ahead_and_packed_into_two_buffers_in_turn():
    pulled = [0]
    maker = BucketMaker(stream(20, 256, pulled), bucket_bytes=4 * 1024, flattened=True)  # 4 tensors a bucket
    buckets, reads, buffers = [], [], []
    while (b := maker.next()) is not None:
        buckets.append(b)
        reads.append(pulled[0])
        buffers.append(b.flat.untyped_storage().data_ptr())
        metas = [(m.name, dtype_from_name(m.dtype), m.shape) for m in b.metas]
        for name, t in unflatten_bucket(b.flat, metas):  # bucket i is intact until bucket i+2 is made
            assert torch.equal(t, torch.full((256,), float(name[1:])))
    assert [len(b.metas) for b in buckets] == [4] * 5 and [b.last for b in buckets] == [False] * 4 + [True]
    assert reads == [5, 9, 13, 17, 20]  # the bucket's tensors and the first of the next, no more
    assert len(set(buffers)) == 2 and buffers[0] == buffers[2] == buffers[4] != buffers[1]
    again = BucketMaker(stream(8, 256, pulled), bucket_bytes=4 * 1024, flattened=True, buffers=maker.buffers)
    assert {again.next().flat.data_ptr(), again.next().flat.data_ptr()} == set(buffers)  # the next sync's too


def test_wider_weights_are_cast_to_the_servers_dtype_and_aligned():
    pulled = [0]
    weights = [("a", torch.ones(3, dtype=torch.float16)), ("b", torch.ones(5) / 3), ("c", torch.arange(4))]
    maker = BucketMaker(iter(weights), bucket_bytes=1 << 20, flattened=True, server_dtype=torch.bfloat16)
    b = maker.next()
    assert [(m.name, m.dtype) for m in b.metas] == [("c", "int64"), ("a", "float16"), ("b", "bfloat16")]
    assert b.flat.numel() == 4 * 8 + 3 * 2 + 5 * 2
    out = dict(unflatten_bucket(b.flat, [(m.name, dtype_from_name(m.dtype), m.shape) for m in b.metas]))
    assert torch.equal(out["b"], (torch.ones(5) / 3).to(torch.bfloat16)) and torch.equal(out["c"], torch.arange(4))
    assert maker.next() is None and pulled == [0]


def test_a_drained_maker_reads_every_remaining_weight():
    pulled = [0]
    maker = BucketMaker(stream(10, 256, pulled), bucket_bytes=2 * 1024, flattened=False)
    assert len(maker.next().metas) == 2
    maker.drain()
    assert pulled == [10] and maker.next() is None


def test_parameters_in_one_buffer_make_every_bucket_a_slice_of_it(tiny_model_dir):
    """weightsync/flat.py: the trainer's bucket is its parameters' own memory (no pack), and the
    same bucket names exactly one slice of a server's flat parameters (received in place)."""
    from transformers import AutoModelForCausalLM

    from rlctl.engines.weightsync.flat import flatten_parameters

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    flat = flatten_parameters(model)
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())  # values kept
    start, end = flat.buffer.data_ptr(), flat.buffer.data_ptr() + flat.buffer.numel()
    assert all(start <= p.data_ptr() < end for p in model.parameters())
    if model.config.tie_word_embeddings:
        assert flat.spans["lm_head.weight"] == flat.spans["model.embed_tokens.weight"]
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    maker = BucketMaker(iter(weights), bucket_bytes=16 * 1024, flattened=True)
    buckets = []
    while (b := maker.next()) is not None:
        buckets.append(b)
        target = flat.slice_for([m.name for m in b.metas], [m.dtype for m in b.metas], [m.nbytes for m in b.metas])
        assert target is not None and target.data_ptr() == b.flat.data_ptr()  # the parameters' own bytes
    assert len(buckets) > 2 and buckets[0].flat.data_ptr() == start
    assert flat.slice_for(["model.norm.weight"], ["bfloat16"], [flat.spans["model.norm.weight"][1]]) is None
    cast = BucketMaker(iter(weights), bucket_bytes=16 * 1024, flattened=True, server_dtype=torch.bfloat16).next()
    assert not start <= cast.flat.data_ptr() < end  # a cast is packed into a buffer of its own


def test_a_sync_refused_at_once_still_reads_every_weight():
    """Other Megatron TP ranks gather as rank 0 reads: a sync that cannot start must still read
    its weights to the end, or they wait in a gather for ever."""
    import asyncio

    import pytest

    from rlctl.engines.weightsync import WeightSender
    from rlctl.errors import RunError

    pulled = [0]
    sender = WeightSender([], master_address="127.0.0.1", master_port=1, backend="gloo", bucket_bytes=1024)
    with pytest.raises(RunError, match="not connected"):
        asyncio.run(sender.send(stream(6, 256, pulled), version="1"))
    assert pulled == [6]
