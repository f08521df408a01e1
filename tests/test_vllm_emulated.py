"""rlctl's vLLM adapter driving real processes: built-in servers answering as vLLM 0.33/0.34 in dev
mode (--emulate-vllm), the trainer side's group and packed buckets over gloo, and whole runs.
What the emulation answers is held to vLLM's source by tests/test_vllm_contract.py."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
import torch

from conftest import QUICKSTART, free_port, processes_mentioning, rlctl, rlctl_here
from rlctl.engines.rollout.protocol import SamplingRequest
from rlctl.engines.rollout.vllm.client import VllmClient, completion_body
from rlctl.engines.weightsync import tensor_sha256
from rlctl.engines.rollout.vllm.sender import VllmWeightSender
from rlctl.errors import RunError
from rlctl.run.dir import RunDir

VERSION = "0.34.0"


@pytest.fixture
def vllm_server(start_server, monkeypatch):
    """start(dev_mode=True) -> the URL of a built-in server emulating vLLM."""
    def start(seed: int = 0, dev_mode: bool = True, version: str = VERSION) -> str:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1" if dev_mode else "0")
        return start_server(seed, "--emulate-vllm", version)
    return start


async def until_the_server_holds(c: VllmClient, state: str, timeout: float = 30.0) -> None:
    """Poll the server's own gauge (vllm:num_requests_running / _waiting on /metrics) until a
    request is in that state: the server's word, not a guess of how long it takes."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        async with c.session.get(c.url + "/metrics", headers=c.headers) as resp:
            text = await resp.text()
        if any(line.startswith(f"vllm:num_requests_{state}{{") and float(line.rsplit(" ", 1)[1]) >= 1
               for line in text.splitlines()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no request {state} on the server after {timeout} s:\n{text}")


@pytest.mark.process
def test_generate_abort_and_pause_as_vllm(vllm_server):
    url = vllm_server()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            assert await c.version() == VERSION and await c.world_size() == 1
            out = await c.generate([1, 22, 3], SamplingRequest(max_new_tokens=4, ignore_eos=True), "r1")
            assert len(out.output_ids) == 4 == len(out.logprobs) == out.completion_tokens
            assert all(lp <= 0 for lp in out.logprobs) and out.finish_reason["type"] == "length"
            assert out.weight_version == "default"  # vLLM's label until the first update
            # abort by our id (vLLM runs it as cmpl-<id>-0), here of a request queued behind a pause in keep mode
            await c.pause_generation("keep")
            queued = asyncio.create_task(c.generate([1, 2], SamplingRequest(max_new_tokens=4), "r2"))
            await until_the_server_holds(c, "waiting")
            assert not queued.done()
            await c.abort("r2")
            aborted = await asyncio.wait_for(queued, 30)
            assert aborted.finish_reason["type"] == "abort" and aborted.output_ids == []
            # pause in abort mode: what is in flight ends; new requests wait (503, sent again) until /resume
            running = asyncio.create_task(c.generate([1, 2], SamplingRequest(max_new_tokens=4), "r3"))
            await until_the_server_holds(c, "waiting")  # still paused (keep): it waits in the engine
            await c.pause_generation("abort")
            assert (await asyncio.wait_for(running, 30)).finish_reason["type"] == "abort"
            assert await c.is_paused()
            async with s.post(url + "/v1/completions", json=completion_body([1, 2], SamplingRequest(max_new_tokens=2), "raw", None),
                              headers=c.headers) as refused:
                assert refused.status == 503  # what the client's own retries below meet until /resume
            waiting = asyncio.create_task(c.generate([1, 2], SamplingRequest(max_new_tokens=2), "r4"))
            await c.continue_generation()
            assert len((await asyncio.wait_for(waiting, 30)).output_ids) > 0
            assert not await c.is_paused()
            with pytest.raises(RunError, match="HTTP 422"):
                await c.pause_generation("retract")  # SGLang's mode, not one of vLLM's

    asyncio.run(scenario())


@pytest.mark.process
@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_bucketed_sync_to_two_servers_is_bit_exact(vllm_server, tiny_model_dir, version):
    from transformers import AutoModelForCausalLM

    urls = [vllm_server(seed=0, version=version), vllm_server(seed=1, version=version)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # weights the servers have never seen
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    expected = {n: tensor_sha256(t) for n, t in model.state_dict().items()}

    async def scenario():
        async with aiohttp.ClientSession() as s:
            clients = [VllmClient(u, s) for u in urls]
            sender = VllmWeightSender(clients, master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                      bucket_bytes=16 * 1024)
            await sender.connect()
            assert (sender.world_size, sender.rank_offsets) == (3, [1, 2])
            for version_sent in ("3", "4"):
                stats = await sender.send(weights, version=version_sent)
                assert stats.buckets > 4 and stats.bytes == sum(t.numel() * 4 for _, t in weights)
                for c in clients:
                    got = await c._get_json("/rlctl/weight_checksums")
                    assert got["checksums"] == expected
                    assert await c.weight_version() == version_sent and not await c.is_paused()
            out = await clients[1].generate([1, 22], SamplingRequest(max_new_tokens=2), "after")
            assert out.weight_version == "4"
            await sender.close()

    asyncio.run(scenario())


@pytest.mark.process
def test_a_server_without_dev_mode_is_named(vllm_server):
    url = vllm_server(dev_mode=False)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            assert await c.version() == VERSION  # the server answers; only the dev routes are missing
            for call in (c.is_paused(), c.pause_generation("abort"), c.world_size()):
                with pytest.raises(RunError, match="without VLLM_SERVER_DEV_MODE=1"):
                    await call

    asyncio.run(scenario())


@pytest.mark.process
def test_a_server_of_another_release_is_refused(vllm_server):
    from rlctl.engines.rollout.vllm.launch import check_version

    url = vllm_server(version="0.32.0")

    async def scenario():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            with pytest.raises(RunError, match=r"vLLM 0\.32\.0 is outside .*\(0\.33\.0 \.\. 0\.34\.0\)"):
                check_version(await c.version())
            sender = VllmWeightSender([c], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                      bucket_bytes=1 << 20)
            with pytest.raises(RunError, match="outside"):
                await sender.connect()

    asyncio.run(scenario())


# -- whole runs ---------------------------------------------------------------------------------

def only_run(tmp_path) -> RunDir:
    (run,) = list((tmp_path / "runs").iterdir())
    return RunDir(run)


@pytest.mark.e2e
def test_quickstart_emulating_vllm_learns_with_every_sync_checked(tmp_path):
    """The quickstart, its servers speaking vLLM: 40 of its 100 steps (the reward has risen by
    then: about 0.3 -> 0.7), buckets of 256 KiB (several per sync), every server's weights checked
    against the trainer's after every sync."""
    res = rlctl("launch", str(QUICKSTART), "rollout.builtin.emulate_vllm=0.33.0", "pipeline.check_weights=true",
                "train.sync_bucket_mb=0.25", "run.steps=40", f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path,
                timeout=900)
    assert res.returncode == 0, res.stderr
    rd = only_run(tmp_path)
    rewards = [m["reward_mean"] for m in rd.metrics()]
    assert len(rewards) == 40
    # Below the seeds' spread: over seeds 0-2 of the quickstart (results/quickstart.json, written by
    # scripts/bench_quickstart.py) steps 30-39 average 0.335-0.400 above steps 0-9.
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.2, (first, last)
    events = rd.events()
    assert len([e for e in events if e["event"] == "weights_checked"]) == 41  # version 0, then every step
    assert next(e for e in events if e["event"] == "initial_sync")["buckets"] > 1
    assert "vLLM 0.33.0 (dev mode)" in rd.log_path("controller").read_text()
    assert "as rank 2 of 3" in rd.log_path("rollout-1").read_text()


@pytest.mark.e2e
def test_a_run_whose_servers_lack_dev_mode_stops_with_one_line(tmp_path):
    res = rlctl("launch", str(QUICKSTART), "rollout.builtin.emulate_vllm=0.34.0", "run.steps=3",
                f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path, timeout=300, env={"VLLM_SERVER_DEV_MODE": "0"})
    assert res.returncode == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "without VLLM_SERVER_DEV_MODE=1" in errors[0], res.stderr
    rd = only_run(tmp_path)
    deadline = time.monotonic() + 10
    while processes_mentioning(rd.id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(rd.id)
    status = json.loads(rlctl("status", rd.id, "--runs-dir", str(tmp_path / "runs"), "--json", cwd=tmp_path).stdout)
    assert status["state"] == "failed"


def fake_install(root, version: str | None) -> dict[str, str]:
    """An environment where `vllm` is importable and installed as `version` (None: not installed).
    Nothing of it runs: rlctl reads the package's metadata before it starts anything."""
    if version is not None:
        (root / "vllm").mkdir()
        (root / "vllm" / "__init__.py").write_text("")
        meta = root / f"vllm-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.process
@pytest.mark.parametrize("installed, says", [
    (None, "needs vllm, which is not installed here: pip install 'vllm>=0.33.0,<=0.34.0'"),
    ("0.32.0", "vLLM 0.32.0 is outside the releases rlctl's adapter was checked against (0.33.0 .. 0.34.0)"),
])
def test_launch_without_a_spoken_vllm_says_so_and_starts_nothing(tmp_path, installed, says):
    env = fake_install(tmp_path, installed)
    res = rlctl("launch", str(QUICKSTART), "rollout.engine=vllm", "rollout.device=cuda", "train.device=cuda",
                f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path, env=env)
    assert res.returncode == 1, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and says in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()  # no run directory: nothing was started


def test_vllm_settings_are_checked_with_the_key_named(tmp_path):
    for override, key in (("rollout.vllm.extra_args=[--port=1]", "rollout.vllm.extra_args[0]"),
                          ("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization"),
                          ("rollout.engine=vllm", "rollout.device"),
                          ("rollout.builtin.emulate_vllm=0.35.0", "rollout.builtin.emulate_vllm")):
        res = rlctl_here("launch", str(QUICKSTART), *override.split(), f"run.output_dir={tmp_path}", cwd=tmp_path)
        assert res.returncode == 2 and f": {key}: " in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
            (override, res.stderr)
    res = rlctl_here("launch", str(QUICKSTART), "rollout.engine=vllm", "rollout.device=cuda", "--dry-run",
                f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2 and ": train.device: " in res.stderr, res.stderr


@pytest.mark.parametrize("method,path,authorization,passes", [
    ("OPTIONS", "/metrics", None, False),
    ("OPTIONS", "/pause", None, False),
    ("OPTIONS", "/v1/completions", None, False),
    ("GET", "/metrics", None, False),  # SGLang leaves /metrics open; a run's vLLM servers do not
    ("POST", "/pause", "Bearer wrong", False),
    ("POST", "/pause", "Basic secret", False),
    ("OPTIONS", "/pause", "Bearer secret", True),  # then the router answers 405: no route data
    ("GET", "/metrics", "Bearer secret", True),
    ("OPTIONS", "/health", None, True),
    ("GET", "/health", None, True),
])
def test_the_emulation_refuses_what_a_runs_vllm_server_refuses(tmp_path, method, path, authorization, passes):
    """The built-in server emulating vLLM is guarded by the door a run puts in front of vLLM
    (TokenDoor): every route but /health, OPTIONS included, asks for the token, and a refused
    request reaches no handler; 401 for a wrong token as for none, as vLLM answers."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from rlctl.engines.rollout.builtin.server import BuiltinServer, parser
    from rlctl.engines.rollout.vllm.auth import TokenDoor

    (tmp_path / "token").write_text("secret\n")
    args = parser().parse_args(["--model-path", str(tmp_path), "--emulate-vllm", VERSION,
                                "--api-key-file", str(tmp_path / "token")])
    door = BuiltinServer(args).app().middlewares[0]
    reached = []

    async def handler(request):
        reached.append(request.path)
        return web.Response(status=200)

    headers = {"Authorization": authorization} if authorization else {}
    response = asyncio.run(door(make_mocked_request(method, path, headers=headers), handler))
    assert (response.status, bool(reached)) == ((200, True) if passes else (401, False))
    if not passes:
        assert json.loads(response.body) == {"error": "Unauthorized"}
    scope = {"method": method, "path": path, "headers": [(b"authorization", authorization.encode())] if authorization else []}
    assert TokenDoor(None, "secret").allowed(scope) is passes  # the same decision as at a real vLLM server


def test_launch_command_keeps_the_token_off_the_command_line():
    from rlctl.engines.rollout.vllm.launch import launch_command, launch_env
    from rlctl.recipe import VllmConfig

    cmd = launch_command("/py", "/m", VllmConfig(tp_size=4, max_model_len=4096, extra_args=["--enforce-eager"]),
                         host="10.0.0.2", port=8000, seed=7)
    assert cmd[:5] == ["/py", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4" and cmd[-1] == "--enforce-eager"
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert "secret" not in " ".join(cmd) and launch_env("secret") == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "secret"}


def test_the_trainer_is_told_the_protocol_and_what_the_servers_hold():
    """vLLM has no route that says its dtype: the controller tells the trainer, which casts wider
    weights to it before they leave (a bf16 Megatron trainer's checked syncs depend on it)."""
    from rlctl.control.controller import sync_target
    from rlctl.recipe import load_recipe

    def told(*overrides):
        return sync_target(load_recipe(QUICKSTART, list(overrides), check_paths=False))
    assert told() == {"protocol": "sglang"}
    assert told("rollout.builtin.emulate_vllm=0.33.0") == {"protocol": "vllm", "server": {"dtype": "float32"}}
    real = told("rollout.engine=vllm", "rollout.device=cuda", "train.device=cuda", "rollout.vllm.dtype=auto",
                "model.init=null", "model.path=~/m")
    assert real["protocol"] == "vllm" and real["server"]["dtype"] == "auto"
    assert real["server"]["model_path"] == os.path.expanduser("~/m")


@pytest.mark.process
@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_the_emulator_replies_in_the_shapes_of_vllms_own_handlers(vllm_server, version):
    """Each control reply of the emulating server has exactly the keys the same route's handler in
    that vLLM release answers 200 with (read from its wheel by tests/vllm_source.py), so the
    emulation is held to vLLM, not to the client it serves."""
    import vllm_source

    try:
        src = vllm_source.source(version)
    except vllm_source.MissingWheel as e:  # run-tests.sh downloads them; CI must have them
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    url = vllm_server(version=version)

    async def replies():
        async with aiohttp.ClientSession() as s:
            c = VllmClient(url, s)
            got = {("GET", "/version"): await c._get_json("/version"),
                   ("GET", "/is_paused"): await c._get_json("/is_paused"),
                   ("GET", "/weight_info"): await c._get_json("/weight_info"),
                   ("GET", "/get_world_size"): await c._get_json("/get_world_size"),
                   ("POST", "/pause"): await c._control("/pause?mode=abort", {}),
                   ("POST", "/resume"): await c._control("/resume", {}),
                   ("POST", "/abort_requests"): await c._control("/abort_requests", {"request_ids": ["x"]}),
                   ("POST", "/start_weight_update"): await c._control("/start_weight_update", {}),
                   ("POST", "/finish_weight_update"): await c._control("/finish_weight_update", {}),
                   ("POST", "/update_weight_version"): await c._control("/update_weight_version", {"new_version": "1"})}
            return got
    for (method, path), body in asyncio.run(replies()).items():
        theirs = {frozenset(r.keys) for r in src.reply_shapes(path, method) if r.status == 200 and r.kind == "json"}
        assert frozenset(body) in theirs, (path, sorted(body), theirs)
