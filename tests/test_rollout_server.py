"""The built-in rollout server over real HTTP: SGLang's /generate and control endpoints, and the
weight broadcast from a trainer-side sender to two running servers, checked bit for bit."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest
import torch

from conftest import free_port
from rlctl.engines.rollout.client import RolloutClient, SamplingRequest
from rlctl.engines.weightsync import WeightSender, tensor_sha256
from rlctl.errors import RunError

pytestmark = pytest.mark.process


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_generate_follows_sglang_response_shape(shared_server):
    url = shared_server
    status, raw = post(url + "/generate", {
        "input_ids": [1, 80, 68, 91, 11], "return_logprob": True, "rid": "r1",
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True},
    })
    assert status == 200
    out = json.loads(raw)
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 5 and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["id"] == "r1" and meta["prompt_tokens"] == 5 and meta["weight_version"] == "default"
    lps = meta["output_token_logprobs"]
    assert [item[1] for item in lps] == out["output_ids"]
    assert all(item[0] <= 0.0 for item in lps)
    assert isinstance(out["text"], str)


def test_batch_input_ids_and_stop_tokens(shared_server):
    url = shared_server
    # Greedy decoding, stop at any token: each request ends after exactly one token.
    vocab = list(range(98))
    status, raw = post(url + "/generate", {
        "input_ids": [[1, 22], [1, 23, 24]],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": vocab},
    })
    assert status == 200
    outs = json.loads(raw)
    assert len(outs) == 2
    for o in outs:
        assert len(o["output_ids"]) == 1
        assert o["meta_info"]["finish_reason"]["type"] == "stop"


def test_type_errors_are_http_400(shared_server):
    url = shared_server
    assert post(url + "/generate", {"input_ids": "oops"})[0] == 400
    assert post(url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "3"}})[0] == 400
    assert post(url + "/generate", {"input_ids": [1, 2], "sampling_params": {"bogus": 1}})[0] == 400


def test_abort_and_pause(shared_server):
    url = shared_server

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)
            await c.pause_generation("in_place")  # queued requests wait while paused
            task = asyncio.create_task(c.generate([1, 22], SamplingRequest(max_new_tokens=50, ignore_eos=True), "long"))
            for _ in range(600):  # until the server says it holds the request (at most 30 s)
                async with c.session.get(url + "/v1/loads") as resp:
                    assert resp.status == 200
                    if (await resp.json())["num_waiting_reqs"] == 1:
                        break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the paused server never queued the request")
            assert not task.done()
            await c.abort("long")
            out = await task
            assert out.finish_reason["type"] == "abort"
            await c.continue_generation()
            out = await c.generate([1, 22], SamplingRequest(max_new_tokens=3, ignore_eos=True), "after")
            assert len(out.output_ids) == 3
            async with c.session.get(url + "/v1/loads") as resp:
                loads = await resp.json()
            assert loads["num_running_reqs"] == 0 and loads["num_generated_tokens"] >= 3
            await c.flush_cache()

    asyncio.run(scenario())


def unseen_weights(model_dir) -> tuple[list, dict[str, str]]:
    """The model's weights moved by a little noise (weights the servers have never seen), and
    each tensor's hash."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return [(n, p.detach()) for n, p in model.named_parameters()], {
        n: tensor_sha256(t) for n, t in model.state_dict().items()}


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "per_tensor"])
def test_weight_broadcast_to_two_servers_is_bit_exact(start_server, tiny_model_dir, flattened):
    urls = [start_server(seed=0), start_server(seed=1)]
    weights, expected = unseen_weights(tiny_model_dir)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            clients = [RolloutClient(u, s) for u in urls]
            before = await clients[0].weight_checksums()
            assert before["checksums"] != expected
            # A small bucket size forces several buckets.
            sender = WeightSender(clients, master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                  bucket_bytes=64 * 1024, flattened=flattened)
            await sender.connect()
            stats = await sender.send(weights, version="7")
            assert stats.buckets > 1 and stats.bytes == sum(t.numel() * 4 for _, t in weights)
            for c in clients:
                got = await c.weight_checksums()
                assert got["checksums"] == expected
                assert await c.weight_version() == "7"
            # The servers generate with the new weights and say so.
            out = await clients[1].generate([1, 22], SamplingRequest(max_new_tokens=2), "v7")
            assert out.weight_version == "7"
            await sender.close()

    asyncio.run(scenario())


def test_a_sync_cut_by_a_dead_server_leaves_the_others_ready_for_the_next(start_server, tiny_model_dir):
    """A server dies in the middle of a sync, after the others opened their update sessions: the
    failed sync closes them, so the sync done again without the dead server is not refused
    ("a weight-update session is already open", as SGLang says) and gives the living one every
    weight. The failover path (rlctl/control/failover.py) does exactly this."""
    urls = [start_server(seed=0), start_server(seed=1)]
    weights, expected = unseen_weights(tiny_model_dir)

    def killing_on_read(k: int):
        """The weights, read lazily; reading the k-th kills the second server (the first buckets,
        and every begin_weight_update, are behind us by then)."""
        for i, item in enumerate(weights):
            if i == k:
                start_server.procs[1].kill()
                start_server.procs[1].wait()
            yield item

    async def scenario():
        async with aiohttp.ClientSession() as s:
            clients = [RolloutClient(u, s) for u in urls]
            sender = WeightSender(clients, master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                  bucket_bytes=4 * 1024)
            await sender.connect()
            with pytest.raises(RunError):
                await sender.send(killing_on_read(6), version="1")
            await sender.close()
            again = WeightSender(clients[:1], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                 bucket_bytes=4 * 1024)
            await again.connect()
            stats = await again.send(weights, version="2")
            assert stats.buckets > 6
            assert (await clients[0].weight_checksums())["checksums"] == expected
            assert await clients[0].weight_version() == "2"
            out = await clients[0].generate([1, 22], SamplingRequest(max_new_tokens=2), "after")
            assert out.weight_version == "2"
            await again.close()

    asyncio.run(scenario())


def test_update_outside_session_is_refused(start_server, tiny_model_dir):
    url = start_server()  # its own: the refused update leaves the weight-update group joined

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)
            sender = WeightSender([c], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                  bucket_bytes=1 << 20)
            await sender.connect()
            sender.session_needed = [False]  # behave like a sender for SGLang < 0.5.21
            with pytest.raises(RunError, match="begin_weight_update"):
                await sender.send([("model.norm.weight", torch.ones(32))], version="1")
            await sender.close()

    asyncio.run(scenario())


def test_served_logprobs_match_a_full_forward_pass(shared_server, tiny_model_dir):
    """Continuous batching with per-request KV caches must score tokens exactly as the trainer's
    full forward pass does: prompts of different lengths, run concurrently, several tokens each."""
    from transformers import AutoModelForCausalLM

    url = shared_server
    prompts = [[1, 80, 68, 91, 11, 22], [1, 23], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 60, 61]]

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)
            return await asyncio.gather(*(
                c.generate(p, SamplingRequest(max_new_tokens=6 + i, ignore_eos=True), f"lp{i}")
                for i, p in enumerate(prompts)))

    outs = asyncio.run(scenario())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p + out.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        want = lp[torch.arange(len(p) - 1, ids.shape[1] - 1), ids[0, len(p):]]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, rtol=0, atol=1e-4)


def test_requests_joining_and_leaving_a_running_batch_score_exactly(start_server, tiny_model_dir):
    """Rows join the shared batch cache while others are mid-decode, leave at different steps,
    and wait in the queue when the batch is full (max 3 running): every token's log-prob must
    still be the one a full forward pass over the whole sequence gives."""
    from transformers import AutoModelForCausalLM

    url = start_server(0, "--max-running-requests", "3")
    prompts = [[1, 80, 68, 91, 11, 22, 5, 6, 7, 8, 9], [1, 23], [1, 40, 41, 42], [1, 60, 61, 62, 63, 64, 65],
               [1, 12], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [1, 70, 71]]
    lengths = [30, 4, 17, 9, 25, 3, 12]

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = RolloutClient(url, s)

            async def one(i):
                await asyncio.sleep(0.02 * i)  # staggered: later prompts join a batch already decoding
                return await c.generate(prompts[i], SamplingRequest(max_new_tokens=lengths[i], ignore_eos=True), f"j{i}")

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    outs = asyncio.run(scenario())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for p, n, out in zip(prompts, lengths, outs):
        assert len(out.output_ids) == n
        ids = torch.tensor([p + out.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        want = lp[torch.arange(len(p) - 1, ids.shape[1] - 1), ids[0, len(p):]]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, rtol=0, atol=1e-4)


def test_a_scheduler_that_fails_ends_its_server(start_server, tmp_path):
    """An engine step that raises (here a token id past the vocabulary; on a GPU, out of memory)
    ends the server's process, as SGLang's scheduler ends its server: a supervisor sees a dead
    server at once, where one whose HTTP side outlived its engine would hold requests until a
    watchdog's timeout."""
    url = start_server()
    proc = start_server.procs[-1]
    with pytest.raises(OSError):  # the connection ends with the process, no reply
        post(url + "/generate", {"input_ids": [1, 10**6], "sampling_params": {"max_new_tokens": 2}})
    assert proc.wait(timeout=30) == 1
    log = next(tmp_path.glob(f"server-{url.rsplit(':', 1)[1]}.log")).read_text()
    assert "the scheduler thread failed; this server exits" in log
