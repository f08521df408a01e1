"""Model processes give their memory back and take it again (rlctl/engines/memory.py), over real HTTP: the built-in
rollout server through SGLang's /release_memory_occupation and /resume_memory_occupation (its routes, bodies, replies
and idle rule held to each supported release's source), and the trainer service through its own routes, on one rank
and two. After a resume everything is bit for bit what it was: checksums, greedy generations, train steps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from conftest import free_port, wait_http
from rlctl.run.checkpoint import save_checkpoint
from rlctl.engines.rollout.builtin.memory_routes import NOT_IDLE, TAGS
from rlctl.engines.rollout.builtin.server import BuiltinServer, parser
from rlctl.engines.rollout.protocol import HEALTH_GENERATION_ENV
from rlctl.engines.rollout.client import RolloutClient, SamplingRequest
from rlctl.engines.weightsync import WeightSender, tensor_sha256
from rlctl.errors import RunError
from sglang_bodies import check_body
from sglang_memory import ROUTES, answers_null, memory_step, memory_tags
from sglang_source import SUPPORTED

pytestmark = pytest.mark.process

PROMPT = [1, 40, 41, 57, 60, 22]
GREEDY = SamplingRequest(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def serve(tiny_model_dir, tmp_path):
    """Built-in servers as real processes: (url, process); all killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*extra: str, model: Path | None = None) -> tuple[str, subprocess.Popen]:
        port = free_port()
        log = (tmp_path / f"server-{port}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rlctl.engines.rollout.builtin.server", "--model-path", str(model or tiny_model_dir),
             "--port", str(port), *extra], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, HEALTH_GENERATION_ENV: "false"}))  # as rlctl starts it: /health says alive
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url, procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))


async def call(s: aiohttp.ClientSession, method: str, url: str, body=None) -> tuple[int, bytes, object]:
    async with s.request(method, url, json=body) as resp:
        raw = await resp.read()
        return resp.status, raw, json.loads(raw) if resp.content_type == "application/json" and raw else raw


def offloaded(root: Path) -> dict[str, os.stat_result]:
    """The files of the private directories under root, by name (each directory checked 0700)."""
    found = {}
    for d in root.glob("rlctl-offload-*"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        found |= {f.name: f.stat() for f in d.iterdir()}
    return found


def load_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


# -- the rollout server ---------------------------------------------------------------------------

def test_release_all_then_resume_all_gives_the_same_model_back(serve, tiny_model_dir, tmp_path):
    url, _ = serve("--offload-dir", str(tmp_path / "off"))
    model = load_model(tiny_model_dir)
    weights = [(n, p.detach() * 1.5) for n, p in model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    async def scenario():
        async with session() as s:
            c = RolloutClient(url, s)
            before, sums = await c.generate(PROMPT, GREEDY, "before"), await c.weight_checksums()
            assert await c.memory() == {"weights_bytes": nbytes,
                                        "resident": {"weights": True, "kv_cache": True}}
            sender = WeightSender([c], master_address="127.0.0.1", master_port=0, backend="ipc", bucket_bytes=16 << 10)
            await sender.connect()
            await c.release_memory_occupation()
            memory = await c.memory()
            assert memory["resident"] == {"weights": False, "kv_cache": False}
            files = offloaded(tmp_path / "off")
            assert list(files) == ["weights"] and files["weights"].st_size == memory["weights_bytes"]
            assert stat.S_IMODE(files["weights"].st_mode) == 0o600
            status, _, data = await call(s, "POST", url + "/generate", {"input_ids": PROMPT})
            assert status == 400 and "memory is released" in data["error"]["message"]  # SGLang's error shape
            assert (await call(s, "GET", url + "/health"))[0] == 200
            with pytest.raises(RunError, match="HTTP 400.*memory is released"):
                await c.weight_checksums()
            with pytest.raises(RunError, match="update_weights_from_tensor.*memory is released"):
                await sender.send(weights, "1")  # refused before any tensor is opened
            with pytest.raises(RunError, match="no weight-update session is open"):
                await c.end_weight_update()  # the refused sync closed its session, but left the pause
            await c.continue_generation()
            await c.resume_memory_occupation()
            assert offloaded(tmp_path / "off") == {}
            after = await c.generate(PROMPT, GREEDY, "after")
            assert (after.output_ids, after.logprobs) == (before.output_ids, before.logprobs)
            assert (await c.weight_checksums())["checksums"] == sums["checksums"]
            await sender.send(weights, "1")  # lands in the restored buffer, in place
            got = (await c.weight_checksums())["checksums"]
            assert {n: got[n] for n, _ in weights} == {n: tensor_sha256(t) for n, t in weights}

    asyncio.run(scenario())


def test_kv_cache_alone_leaves_the_weights_and_wrong_requests_are_refused(serve):
    url, _ = serve()

    async def scenario():
        async with session() as s:
            c = RolloutClient(url, s)
            sums = await c.weight_checksums()
            await c.release_memory_occupation(["kv_cache"])
            assert (await c.memory())["resident"] == {"weights": True, "kv_cache": False}
            assert await c.weight_checksums() == sums  # the weights stayed
            status, _, data = await call(s, "POST", url + "/generate", {"input_ids": PROMPT})
            assert status == 400 and set(data) == {"error"}
            with pytest.raises(RunError, match=r"HTTP 400\): cannot resume 'weights': it is not released"):
                await c.resume_memory_occupation(["weights"])
            with pytest.raises(RunError, match="unknown memory tag 'kv'; the tags are kv_cache, weights, cuda_graph"):
                await c.release_memory_occupation(["kv"])
            assert (await call(s, "POST", url + "/release_memory_occupation", {"tags": "weights"}))[0] == 422
            assert (await call(s, "GET", url + "/release_memory_occupation"))[0] == 422  # the body is required
            await c.resume_memory_occupation(["kv_cache"])
            assert len((await c.generate(PROMPT, GREEDY, "r")).output_ids) == GREEDY.max_new_tokens

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory) -> Path:
    """A random model of some 50 MB, enough for its release to show in the process's RSS."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=64,
                         tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("big")
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out


def rss(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_cpu_server_gives_the_weights_memory_back(serve, big_model_dir, tmp_path):
    url, proc = serve("--offload-dir", str(tmp_path / "off"), model=big_model_dir)

    async def scenario():
        async with session() as s:
            c = RolloutClient(url, s)
            sums, size, held = await c.weight_checksums(), (await c.memory())["weights_bytes"], rss(proc.pid)
            assert size > 40 << 20
            await c.release_memory_occupation(["weights"])
            released = rss(proc.pid)
            assert held - released > 0.9 * size, (held, released, size)
            await c.resume_memory_occupation(["weights"])
            assert rss(proc.pid) - released > 0.9 * size
            assert await c.weight_checksums() == sums

    asyncio.run(scenario())


# -- the same routes, held to each SGLang release -------------------------------------------------

async def idle_rule(s: aiohttp.ClientSession, url: str, c: RolloutClient) -> tuple[int, object]:
    """Release with one request queued behind a pause: (status, reply); the request then runs."""
    await c.pause_generation("in_place")
    waiting = asyncio.create_task(c.generate(PROMPT, GREEDY, "queued"))
    while (await call(s, "GET", url + "/v1/loads"))[2]["num_waiting_reqs"] != 1:
        await asyncio.sleep(0.05)
    status, _, data = await call(s, "POST", url + "/release_memory_occupation", {"tags": ["kv_cache"]})
    if status == 200:
        await c.resume_memory_occupation(["kv_cache"])
    await c.continue_generation()
    assert len((await waiting).output_ids) == GREEDY.max_new_tokens
    return status, data


def assert_error_reply(src, path: str, method: str, status: int, data) -> None:
    """One of the handler's replies: _create_error_response, 400 unless the exception says otherwise."""
    shapes = src.reply_shapes(path, method)
    assert status == 400 and isinstance(data, dict) and set(data) == {"error"} and set(data["error"]) == {"message"}
    assert any(r.kind == "json" and r.keys == {"error"} and str(r.status) in ("400", "getattr(e, 'status_code', "
               "HTTPStatus.BAD_REQUEST)") for r in shapes), shapes


@pytest.mark.parametrize("version", SUPPORTED)
def test_memory_routes_are_sglangs(sglang, serve, tmp_path, version):
    src = sglang(version)
    record = tmp_path / "requests.jsonl"
    url, _ = serve("--emulate-sglang", version, "--record-requests", str(record))
    served = BuiltinServer(parser().parse_args(["--model-path", "unused", "--emulate-sglang", version])).routes()
    for path in ROUTES:
        assert {m for m, p, _ in served if p == path} == src.routes()[path]
    assert list(TAGS) == memory_tags(src)
    step = memory_step(src, "release_memory_occupation")

    async def scenario():
        async with session() as s:
            c = RolloutClient(url, s)
            await c.release_memory_occupation()
            for method, path, body in (("GET", ROUTES[1], {"tags": ["weights"]}),
                                       ("POST", ROUTES[1], {"tags": ["kv_cache", "cuda_graph"]}),
                                       ("GET", ROUTES[0], {"tags": []}), ("POST", ROUTES[1], {"tags": []})):
                status, raw, _ = await call(s, method, url + path, body)  # [] is every tag, as null is
                assert (status, raw) == (200, b"null") and answers_null(src, path, method)
            status, _, data = await call(s, "GET", url + ROUTES[1], {"tags": None})
            assert_error_reply(src, ROUTES[1], "GET", status, data)  # nothing is released
            status, data = await idle_rule(s, url, c)
            if "ignore_waiting" in step.idle_check:  # 0.5.21 on: a request queued behind a pause is no work
                assert status == 200
            else:
                assert_error_reply(src, ROUTES[0], "POST", status, data)
                assert data["error"]["message"] == step.idle_message == NOT_IDLE
            await c.release_memory_occupation(["weights", "cuda_graph"])
            await c.resume_memory_occupation(["cuda_graph", "weights"])

    asyncio.run(scenario())
    bodies = [(r["path"], r["body"]) for r in map(json.loads, record.read_text().splitlines()) if r["path"] in ROUTES]
    assert len(bodies) >= 5
    for path, body in bodies:
        check_body(src, path, body)


# -- the trainer service ----------------------------------------------------------------------------

def _trainer(rank: int, world: int, dist_port: int, port: int, model_dir: str, offload_dir: str, kl_coef: float,
             run_dir: str) -> None:
    import torch.distributed as dist
    from aiohttp import web

    from rlctl.engines.train.service import TrainerService, follower_loop
    from rlctl.engines.train.torch_engine import TorchTrainEngine
    from rlctl.recipe import AlgoConfig, TrainConfig

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
    engine = TorchTrainEngine(model_dir, TrainConfig(lr=1e-2, grad_clip=1e9), temperature=1.0, rank=rank,
                              world_size=world, offload_dir=offload_dir, algo=AlgoConfig(kl_coef=kl_coef))
    if rank == 0:
        web.run_app(TrainerService(engine, world, run_dir=run_dir).app(), host="127.0.0.1", port=port, print=None,
                    access_log=None)
    else:
        follower_loop(engine)


@pytest.fixture
def trainers(tiny_model_dir, tmp_path):
    """start(world, offload_dir, kl_coef) -> URL of a trainer service of `world` ranks (processes),
    whose run directory (where its checkpoints go) is offload_dir."""
    import multiprocessing as mp

    procs = []

    def start(world: int, offload: Path, kl_coef: float = 0.0) -> str:
        offload.mkdir(parents=True, exist_ok=True)
        port, dist_port = free_port(), free_port()
        for rank in range(world):
            procs.append(mp.get_context("spawn").Process(target=_trainer, daemon=True, args=(
                rank, world, dist_port, port, str(tiny_model_dir), str(offload / f"rank-{rank}"), kl_coef, str(offload))))
            procs[-1].start()
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


def samples(n: int = 12) -> list[dict]:
    from test_trainer import make_samples

    return [dataclasses.asdict(s) for s in make_samples(n)]


async def optimizer_state(c, run: Path) -> dict:
    saved = await save_checkpoint(run, 1, c, {"t": 0.0}, keep=0)
    return torch.load(Path(saved["path"]) / "trainer" / "optimizer.pt", weights_only=True)["state"]


def test_a_trainer_that_released_steps_as_one_that_never_did(trainers, tmp_path):
    from rlctl.engines.train.client import TrainerClient

    urls = [trainers(1, tmp_path / name, kl_coef=0.1) for name in ("a", "b")]
    first, second = samples()[:6], samples()[6:]

    async def scenario():
        async with session() as s:
            a, b = (TrainerClient(u, s) for u in urls)
            await asyncio.gather(a.wait_healthy(120), b.wait_healthy(120))
            for c in (a, b):
                await c.train(first)
                await c.accumulate(second[:3])  # half a batch: its gradients must come back too
            info = await a.info()
            moved = await a.release_memory_occupation()
            memory = info["memory"]
            assert moved["released"] == ["weights", "optimizer"]
            assert moved["bytes"] == memory["weights_bytes"] + memory["optimizer_bytes"] > 0
            assert (await a.info())["memory"]["resident"] == {"weights": False, "optimizer": False}
            files = offloaded(tmp_path / "a" / "rank-0")
            assert set(files) == {"gradients", "reference-weights", "weights", "optimizer"}
            assert all(stat.S_IMODE(f.st_mode) == 0o600 for f in files.values())
            with pytest.raises(RunError, match="HTTP 400.*weights and optimizer memory is released"):
                await a.train(second[3:])
            assert (await a.release_memory_occupation())["released"] == []
            assert (await a.resume_memory_occupation(["weights"]))["resumed"] == ["weights"]
            with pytest.raises(RunError, match="optimizer memory is released"):
                await a.train(second[3:])
            with pytest.raises(RunError, match="unknown memory tag 'kv_cache'"):
                await a.release_memory_occupation(["kv_cache"])
            assert (await a.resume_memory_occupation())["resumed"] == ["optimizer"]
            assert offloaded(tmp_path / "a" / "rank-0") == {}
            ours, theirs = await optimizer_state(a, tmp_path / "a"), await optimizer_state(b, tmp_path / "b")
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[i][k], theirs[i][k]) for i in ours for k in ours[i])
            sa, sb = await a.train(second[3:]), await b.train(second[3:])
            assert {**sa, "seconds": 0} == {**sb, "seconds": 0}
            assert (await a.weight_checksums()) == (await b.weight_checksums())

    asyncio.run(scenario())


def test_two_ranks_release_and_resume_together(trainers, tmp_path):
    """The command reaches the other rank (its own offload files), and the step after the resume
    is the one taken from the same state without it (a checkpoint brings that state back)."""
    from rlctl.engines.train.client import TrainerClient

    url = trainers(2, tmp_path)
    first, second = samples()[:6], samples()[6:]

    async def scenario():
        async with session() as s:
            c = TrainerClient(url, s)
            await c.wait_healthy(120)
            await c.train(first)
            saved = await save_checkpoint(tmp_path, 1, c, {"t": 0.0}, keep=0)
            expected, sums = await c.train(second), await c.weight_checksums()
            await c.load_checkpoint(saved["path"])
            await c.release_memory_occupation()
            assert set(offloaded(tmp_path / "rank-1")) == {"weights", "optimizer"}  # no gradients since the load
            await c.resume_memory_occupation()
            assert offloaded(tmp_path / "rank-1") == {}
            got = await c.train(second)
            assert {**got, "seconds": 0} == {**expected, "seconds": 0}
            assert await c.weight_checksums() == sums

    asyncio.run(scenario())
