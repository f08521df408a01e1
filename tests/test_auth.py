"""The door (rlctl/process/auth.py): the run's token guards every endpoint of its servers and trainer but
/health, weight groups form with the run's own trainer only, a local run listens on loopback
only, and the token shows nowhere but in its 0600 file. Real servers, real runs, real sockets."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import aiohttp
import pytest
import torch

import sglang_source
from conftest import FAST, QUICKSTART, descendants, ensure_wheel, free_port, rlctl, rlctl_here, wait_for
from rlctl.errors import RunError
from rlctl.process.auth import TOKEN_FILE, key_of, new_token, read_token, role_key
from rlctl.engines.rollout.sglang.launch import options_file
from rlctl.engines.rollout.client import RolloutClient
from rlctl.engines.weightsync import WeightSender
from rlctl.errors import RecipeError
from rlctl.recipe import load_recipe, recipe_from_yaml
from rlctl.run.dir import RunDir, create_run_dir


def call(url: str, body: dict | None = None, token: str | None = None) -> tuple[int, bytes]:
    """GET (body None) or POST url; (status, body), with `Authorization: Bearer token` if given."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
         "group_name": "weight_update_group", "backend": "gloo"}
UPDATE = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "weight_update_group",
          "flush_cache": True, "abort_all_requests": False, "weight_version": "1", "load_format": None}
GUARDED = [("/rlctl/weight_checksums", None), ("/get_weights_by_name", {"name": "model.norm.weight"}),
           ("/init_weights_update_group", GROUP), ("/update_weights_from_distributed", UPDATE),
           ("/generate", {"input_ids": [1, 2]}), ("/server_info", None), ("/pause_generation", {"mode": "abort"})]


@pytest.fixture
def keyed_server(start_server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(new_token() + "\n")
    url = start_server(0, "--api-key-file", str(token_file), "--weight-group-master", "127.0.0.1")
    return url, token_file.read_text().strip()


@pytest.mark.process
def test_builtin_server_asks_every_route_but_health_for_the_token(keyed_server):
    url, token = keyed_server
    assert call(url + "/health")[0] == 200  # probes need no secret, as with SGLang
    for path, body in GUARDED:
        status, reply = call(url + path, body)
        assert status == 401, (path, status, reply)
        assert json.loads(reply) == {"error": "Unauthorized"}  # SGLang's refusal body
        assert call(url + path, body, token="not-" + token)[0] == 403, path
    status, reply = call(url + "/rlctl/weight_checksums", token=token)
    assert status == 200 and "model.norm.weight" in json.loads(reply)["checksums"]
    status, reply = call(url + "/get_weights_by_name", {"name": "model.norm.weight"}, token=token)
    assert status == 200 and len(json.loads(reply)) == 32


@pytest.mark.process
def test_a_foreign_weight_group_is_refused(keyed_server):
    url, token = keyed_server
    start = time.monotonic()
    status, reply = call(url + "/init_weights_update_group", {**GROUP, "master_address": "10.255.0.9"}, token=token)
    assert status == 400
    body = json.loads(reply)
    assert body["success"] is False and "not this run's trainer" in body["message"]
    assert time.monotonic() - start < 5  # refused before trying to reach that address


def _listen_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (hex, as /proc/net/tcp* has them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.append(local.rsplit(":", 1)[0])
    return found


@pytest.mark.process
def test_with_the_token_a_sync_loads_weights_and_the_store_listens_on_loopback_until_the_group_forms(
        keyed_server, tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlctl.engines.weightsync import store

    url, token = keyed_server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = [(n, torch.full_like(p, 42.0) if n == "model.norm.weight" else p.detach())
               for n, p in model.named_parameters()]
    port = free_port()
    listening: list[list[str]] = []

    class Watched(store.HostedStore):
        """The real store; /proc is read the moment it listens, before any rank can join (a
        poll from the event loop missed the whole window on a loaded machine)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            listening.append(_listen_addresses(self.port))

    monkeypatch.setattr(store, "HostedStore", Watched)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            sender = WeightSender([RolloutClient(url, s, token)], master_address="127.0.0.1", master_port=port,
                                  backend="gloo", bucket_bytes=1 << 20)
            await sender.connect()
            formed = _listen_addresses(port)
            await sender.send(weights, version="1")
            await sender.close()
            return formed

    formed = asyncio.run(scenario())
    assert listening == [["0100007F"]]  # the group's store: 127.0.0.1 only, not every address of the host
    assert formed == []  # and closed once the group is formed (rlctl/engines/weightsync/store.py)
    status, reply = call(url + "/get_weights_by_name", {"name": "model.norm.weight"}, token=token)
    assert status == 200 and json.loads(reply)[:3] == [42.0, 42.0, 42.0]


# -- a whole local run ---------------------------------------------------------------------------


def _listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address in hex, port) of every TCP socket the processes listen on."""
    inodes = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                addr, port = f[1].rsplit(":", 1)
                out.append((inodes[f[9]], addr, int(port, 16)))
    return out


LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def _check_live_run(rd: RunDir, token: str) -> None:
    info = rd.read()
    pids = descendants({p["pid"] for p in info["processes"].values() if p.get("pid")})
    listeners = _listeners(pids)
    plan = info["plan"]
    ports = {r["port"] for r in plan["rollout"]} | {plan["trainers"][0]["port"]}
    assert ports <= {port for _, _, port in listeners}, listeners  # every server of the run was found
    # the weight-sync group's store is closed once the group is formed (rlctl/engines/weightsync/store.py)
    assert plan["weight_sync_port"] not in {port for _, _, port in listeners}, listeners
    outside = [(pid, a, port) for pid, a, port in listeners if a not in LOOPBACK]
    assert not outside, f"listening outside loopback: {outside}"
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert token.encode() not in cmdline, pid
    trainer = f"http://127.0.0.1:{plan['trainers'][0]['port']}"
    servers = [f"http://127.0.0.1:{r['port']}" for r in plan["rollout"]]
    keys = {role: key_of(token, info["processes"], role) for role in ("trainer-0", "rollout-0", "rollout-1")}
    assert call(trainer + "/health")[0] == 200
    assert call(trainer + "/shutdown", {})[0] == 401
    assert call(trainer + "/shutdown", {}, token=token[::-1])[0] == 403
    assert call(trainer + "/weight_checksums", token=keys["trainer-0"])[0] == 200
    assert call(servers[0] + "/rlctl/weight_checksums")[0] == 401
    assert call(servers[0] + "/rlctl/weight_checksums", token=keys["rollout-0"])[0] == 200
    # Each process takes its own key only: not the run's token (which never goes over the wire),
    # not another process's key.
    assert call(trainer + "/weight_checksums", token=token)[0] == 403
    assert call(trainer + "/weight_checksums", token=keys["rollout-0"])[0] == 403
    assert call(servers[0] + "/rlctl/weight_checksums", token=token)[0] == 403
    assert call(servers[0] + "/rlctl/weight_checksums", token=keys["rollout-1"])[0] == 403
    assert call(servers[1] + "/rlctl/weight_checksums", token=keys["rollout-0"])[0] == 403


@pytest.mark.e2e
def test_a_local_run_keeps_its_door_shut(tmp_path):
    res = rlctl("launch", "--detach", str(QUICKSTART), *FAST, "run.steps=500", f"run.output_dir={tmp_path / 'runs'}",
                cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rd = RunDir(tmp_path / "runs" / res.stdout.strip())
    assert stat.S_IMODE(rd.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((rd.path / TOKEN_FILE).stat().st_mode) == 0o600
    token = read_token(rd.path)
    try:
        wait_for(lambda: len(rd.metrics()) >= 1, 300, "the run's first step")
        _check_live_run(rd, token)
        key = key_of(token, rd.read()["processes"], "trainer-0")
        status, _ = call(f"http://127.0.0.1:{rd.read()['plan']['trainers'][0]['port']}/shutdown", {}, token=key)
        assert status == 200  # with its key, the trainer does shut down, and the run with it
        wait_for(lambda: rd.read()["state"] == "failed", 60, "the run to end without its trainer")
    finally:
        rlctl("cancel", str(rd.path), cwd=tmp_path)
    compared = rlctl("compare", str(rd.path), str(rd.path), "--json", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    files = [rd.recipe_path, rd.run_json, rd.events_path, rd.metrics_path, *rd.logs.glob("*.log")]
    assert len(files) > 8
    for f in files:
        assert token not in f.read_text(), f
    assert token not in compared.stdout + compared.stderr


# -- the token's files, the recipe, SGLang ---------------------------------------------------------


def test_run_directories_are_private_unless_shared_with_the_group(tmp_path):
    private = create_run_dir(tmp_path, "a", "run: {}\n", {})
    shared = create_run_dir(tmp_path, "b", "run: {}\n", {}, shared_group=True)
    assert stat.S_IMODE(private.path.stat().st_mode) == 0o700
    assert stat.S_IMODE(shared.path.stat().st_mode) == 0o750
    for rd in (private, shared):
        assert stat.S_IMODE((rd.path / TOKEN_FILE).stat().st_mode) == 0o600
    assert read_token(private.path) != read_token(shared.path) and len(read_token(private.path)) >= 40


def test_the_retired_api_key_is_refused_in_one_line(tmp_path):
    res = rlctl_here("launch", str(QUICKSTART), "rollout.sglang.api_key=s3cret", f"run.output_dir={tmp_path / 'runs'}",
                cwd=tmp_path)
    assert res.returncode == 2 and not (tmp_path / "runs").exists()
    assert len(res.stderr.strip().splitlines()) == 1 and "rollout.sglang.api_key" in res.stderr
    assert "token" in res.stderr and "s3cret" not in res.stderr
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  init: {}\nrollout:\n  sglang:\n    api_key: s3cret\n")
    with pytest.raises(RecipeError, match="rollout.sglang.api_key: removed"):
        load_recipe(recipe)
    # An older run's resolved recipe has the key empty: it still loads.
    assert recipe_from_yaml("rollout:\n  sglang:\n    api_key: ''\n", "old/recipe.yaml").rollout.sglang.tp_size == 1


@pytest.mark.parametrize("version", sglang_source.SUPPORTED)
def test_sglang_reads_the_token_as_its_api_key_from_the_config_file(tmp_path, version):
    """The --config file rlctl writes becomes `--api-key TOKEN` in SGLang's own config parser (run
    from its wheel: it imports only argparse and yaml), for every supported release."""
    import argparse

    ensure_wheel(version)
    with zipfile.ZipFile(sglang_source.wheel(version)) as z:
        (name,) = [n for n in z.namelist() if n.endswith("server_args_config_parser.py")]
        (tmp_path / "parser.py").write_bytes(z.read(name))
    spec = importlib.util.spec_from_file_location(f"sglang_config_parser_{version}", tmp_path / "parser.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--api-key", "--config"):
        parser.add_argument(flag)
    token = new_token()
    config = options_file(tmp_path / "sglang-rollout-0.yaml", token)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    argv = module.ConfigArgumentMerger(parser).merge_config_with_args(["--model-path", "m", "--config", str(config)])
    assert parser.parse_args(argv).api_key == token


# What an SGLang server does at its end (launch_server's kill_process_tree), then its last words.
LAST_WORDS = """import os, signal, sys
from pathlib import Path
for p in Path("/proc").iterdir():
    if p.name.isdigit() and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
        os.kill(int(p.name), signal.SIGKILL)
print("server_args api_key=" + os.environ["T"], flush=True)
print(os.environ["T"], file=sys.stderr)
"""


@pytest.mark.process
def test_redacted_output_hides_the_token_from_the_log(tmp_path):
    token, log = new_token(), tmp_path / "server.log"
    script = ("import os, sys; from rlctl.process.auth import redact_output; t = sys.stdin.readline().strip(); "
              f"redact_output(t); os.execve(sys.executable, [sys.executable, '-c', {LAST_WORDS!r}], {{'T': t}})")
    with log.open("wb") as out:
        subprocess.run([sys.executable, "-c", script], input=token + "\n", text=True, stdout=out,
                       stderr=subprocess.STDOUT, check=True, timeout=30)
    wait_for(lambda: log.read_text().count("\n") >= 2, 10, "the filter to write both lines")
    text = log.read_text()
    assert token not in text and text.count("<run token>") == 2 and "server_args api_key=<run token>" in text


def test_each_start_of_each_process_has_its_own_key_and_none_opens_another():
    token = new_token()
    keys = {(role, kid): role_key(token, role, kid) for role in ("rollout-0", "rollout-1", "trainer-0")
            for kid in ("a1", "b2")}
    assert len(set(keys.values())) == len(keys)  # per role and per start
    assert all(k.startswith("rk_") and token not in k for k in keys.values())
    assert role_key(token, "rollout-0", "a1") == keys[("rollout-0", "a1")]  # derived, not stored
    assert role_key(new_token(), "rollout-0", "a1") != keys[("rollout-0", "a1")]  # and only from this run's token
    processes = {"rollout-0": {"pid": 1, "key_id": "b2"}, "rollout-1": {"pid": 2}}
    assert key_of(token, processes, "rollout-0") == keys[("rollout-0", "b2")]
    with pytest.raises(RunError, match="rollout-1 has recorded no key in run.json"):
        key_of(token, processes, "rollout-1")
