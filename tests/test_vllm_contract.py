"""rollout.engine=vllm, held to vLLM's own source (tests/vllm_source.py reads the wheel of each
supported release): the routes VllmClient calls and which need dev mode, the replies' keys, the
engine's request ids, the `vllm serve` command line, the api-key gap TokenDoor fills, and the
weight-transfer ranks. The client driven over HTTP against replies of vLLM's shapes is
tests/test_vllm_client_contract.py. Without the wheels (scripts/run-tests.sh downloads them) the
module is skipped; under CI it fails."""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import os
from types import SimpleNamespace

import pytest

import vllm_source
from rlctl.engines.rollout.protocol import SamplingRequest
from rlctl.engines.rollout.builtin.vllm_routes import SCHEDULER_GAUGES
from rlctl.engines.rollout.vllm.launch import DOOR, check_version, launch_command, launch_env
from rlctl.engines.rollout.vllm.client import DEV_GETS
from rlctl.engines.rollout.vllm.auth import TokenDoor
from rlctl.errors import RunError
from rlctl.recipe import VLLM_NEWEST, VLLM_OLDEST, VllmConfig
from vllm_source import ARG_UTILS, RL_ROUTER, SUPPORTED, MissingWheel, Reply, literal_values


def wheel_missing(version: str) -> str:
    """Why the wheel of `version` is not here; "" when it is."""
    try:
        vllm_source.wheel(version)
    except MissingWheel as e:
        return str(e)
    return ""


if any(map(wheel_missing, SUPPORTED)) and not os.environ.get("CI"):
    pytest.skip("vLLM's wheels are not here (scripts/run-tests.sh downloads them): "
                + "; ".join(filter(None, map(wheel_missing, SUPPORTED))), allow_module_level=True)

# Every route VllmClient uses, and its method.
CLIENT_ROUTES = {("POST", "/v1/completions"), ("GET", "/version"), ("GET", "/health"), ("POST", "/pause"),
                 ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/abort_requests"), ("GET", "/weight_info"),
                 ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
                 ("POST", "/finish_weight_update"), ("POST", "/update_weight_version"), ("GET", "/get_world_size"),
                 ("POST", "/shutdown_weight_transfer_engine")}
OPEN_ROUTES = {("POST", "/v1/completions"), ("GET", "/version"), ("GET", "/health")}  # served without dev mode
# The JSON body each weight route takes: its Body(embed=True) parameters.
BODY_PARAMS = {"/init_weight_transfer_engine": {"init_info"}, "/update_weights": {"update_info"},
               "/finish_weight_update": {"weight_version"}, "/update_weight_version": {"new_version"}}
# The keys of each 200 reply the client reads.
REPLIES = {("POST", "/pause"): {"status"}, ("POST", "/resume"): {"status"}, ("GET", "/is_paused"): {"is_paused"},
           ("POST", "/abort_requests"): {"status", "aborted"}, ("GET", "/weight_info"): {"weight_version"},
           ("GET", "/get_world_size"): {"world_size"}, ("GET", "/version"): {"version"}}
# What rlctl's trainer sends as init_info (NCCL rendezvous by address, packed buckets).
INIT_INFO_KEYS = ("master_address", "master_port", "rank_offset", "world_size", "packed", "packed_buffer_size_bytes",
                  "packed_num_buffers")
LAUNCH_FLAGS = {"--host", "--port", "--tensor-parallel-size", "--dtype", "--gpu-memory-utilization", "--seed",
                "--weight-transfer-config", "--middleware", "--max-model-len"}
NCCL = "vllm/distributed/weight_transfer/nccl_engine.py"
INIT_INFO = "vllm/distributed/weight_transfer/nccl_common.py"
MIDDLEWARE = "vllm/entrypoints/serve/middleware/"  # authenticate.py, register.py
CLI_MAIN = "vllm/entrypoints/cli/main.py"
CLI_SERVE = "vllm/entrypoints/cli/serve.py"
LOGGERS = "vllm/v1/metrics/loggers.py"
METRICS_ROUTE = "vllm/entrypoints/serve/instrumentator/metrics.py"
SAMPLING = SamplingRequest(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=-1, stop_token_ids=[2], ignore_eos=False)


@pytest.fixture(scope="module")
def vllm():
    """vllm(version) -> the Source of that version's wheel (MissingWheel, failing the test, only under CI)."""
    return vllm_source.source


def test_check_version_speaks_the_supported_releases_only():
    assert SUPPORTED[0] == ".".join(map(str, VLLM_OLDEST)) and SUPPORTED[-1] == ".".join(map(str, VLLM_NEWEST))
    assert [check_version(v) for v in SUPPORTED] == [tuple(map(int, v.split("."))) for v in SUPPORTED]
    for outside in ("0.32.0", "0.35.0"):
        with pytest.raises(RunError, match=f"{SUPPORTED[0]} .. {SUPPORTED[-1]}"):
            check_version(outside)


@pytest.mark.parametrize("version", SUPPORTED)
def test_each_wheel_is_the_version_it_is_named(vllm, version):
    assert vllm(version).version == version
    assert vllm_source.wheel(version).name.startswith(f"vllm-{version}-")


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_emulated_metrics_are_vllms_scheduler_gauges(vllm, version):
    """/metrics is mounted in every mode (instrumentator/metrics.py), and the two gauges the emulation
    serves are declared in vLLM's loggers.py with these names and documentation strings."""
    src = vllm(version)
    mounts = [c for c in ast.walk(src.module(METRICS_ROUTE)) if isinstance(c, ast.Call)
              and getattr(c.func, "id", None) == "Mount" and c.args and isinstance(c.args[0], ast.Constant)]
    assert [c.args[0].value for c in mounts] == ["/metrics"]
    declared = {}
    for call in ast.walk(src.module(LOGGERS)):
        kw = {k.arg: k.value for k in getattr(call, "keywords", []) if isinstance(k.value, ast.Constant)}
        if isinstance(call, ast.Call) and "name" in kw and "documentation" in kw:
            declared[kw["name"].value] = kw["documentation"].value
    assert {name: declared.get(name) for name in SCHEDULER_GAUGES} == {
        name: doc for name, (_, doc) in SCHEDULER_GAUGES.items()}


@pytest.mark.parametrize("version", SUPPORTED)
def test_dev_mode_gates_exactly_the_trainer_routes(vllm, version):
    src = vllm(version)
    gated = {(m, p) for m, p in CLIENT_ROUTES if src.route(p, m).dev_only}
    assert gated == CLIENT_ROUTES - OPEN_ROUTES
    assert {p for m, p in gated if m == "GET"} == set(DEV_GETS)  # the GETs whose 404 means "dev mode off"
    assert not src.route("/v1/completions", "POST").dev_only
    assert all(src.route(p, m).rel == RL_ROUTER for m, p in gated)
    # launch_env turns dev mode on, and gives vLLM its api key, as vllm/envs.py reads them
    env = launch_env("secret")
    assert (vllm_env(src, "VLLM_SERVER_DEV_MODE", env), vllm_env(src, "VLLM_SERVER_DEV_MODE", {})) == (True, False)
    assert vllm_env(src, "VLLM_API_KEY", env) == "secret"


def vllm_env(src: vllm_source.Source, name: str, environ: dict[str, str]) -> object:
    """vllm.envs.<name> under `environ`: the `lambda: ...` of envs.py's table, evaluated over it."""
    (getter,) = [v for d in ast.walk(src.module("vllm/envs.py")) if isinstance(d, ast.Dict)
                 for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and k.value == name]
    fake_os = SimpleNamespace(getenv=environ.get, environ=environ)
    code = compile(ast.Expression(getter.body), "vllm/envs.py", "eval")
    return eval(code, {"__builtins__": {"bool": bool, "int": int, "str": str}, "os": fake_os})


def fits(value: object, annotation: str) -> bool:
    """Does a JSON value's type appear in a field's annotation (an int where a float is taken too)?"""
    names = {bool: ["bool"], int: ["int", "float"], float: ["float"], str: ["str"], list: ["list["]}[type(value)]
    return any(name in annotation for name in names)


def vllm_group(name: str):
    """rlctl.engines.rollout.vllm.group's `name`."""
    return getattr(importlib.import_module("rlctl.engines.rollout.vllm.group"), name)


def test_the_trainer_sends_these_init_info_keys():
    assert tuple(vllm_group("INIT_INFO_KEYS")) == INIT_INFO_KEYS


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_replies_have_the_keys_the_client_reads(vllm, version):
    src = vllm(version)
    for (method, path), keys in REPLIES.items():
        ok = [r for r in src.reply_shapes(path, method) if r.status == 200]
        assert [(r.kind, r.keys, r.unresolved) for r in ok] == [("json", frozenset(keys), ())], path
    refusals = [r for r in src.reply_shapes("/pause", "POST") if r.status != 200]
    assert refusals and all((r.kind, r.keys) == ("json", {"error"}) for r in refusals)


@pytest.mark.parametrize("version", SUPPORTED)
def test_abort_requests_takes_external_ids(vllm, version):
    handler = vllm(version).route("/abort_requests", "POST").handler
    assert [ast.unparse(c) for c in calls(handler, "body.get")] == ["body.get('request_ids')"]
    (branch,) = [n for n in ast.walk(handler) if isinstance(n, ast.If) and ast.unparse(n.test) == "request_ids"]
    given = [c for s in branch.body for c in calls(s, "engine.abort")]
    assert [(ast.unparse(c.args[0]), [k.arg for k in c.keywords]) for c in given] == [("request_ids", [])]


def calls(node: ast.AST, callee: str) -> list[ast.Call]:
    """The calls under node whose function is written `callee` ("engine.abort")."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == callee]


@pytest.mark.parametrize("version", SUPPORTED)
def test_vllms_api_key_leaves_the_dev_routes_open(vllm, version):
    guarded = ast.literal_eval(vllm(version).assignment(MIDDLEWARE + "authenticate.py", "GUARDED_PREFIX"))
    assert "/v1/completions".startswith(guarded)
    assert not [p for m, p in CLIENT_ROUTES - OPEN_ROUTES if p.startswith(guarded)]  # hence TokenDoor


@pytest.mark.parametrize("version", SUPPORTED)
def test_vllm_builds_a_middleware_class_from_the_app_alone(vllm, version):
    register = vllm(version).function(MIDDLEWARE + "register.py", "init_entrypoints_middleware")
    (loop,) = [n for n in ast.walk(register) if isinstance(n, ast.For) and ast.unparse(n.iter) == "args.middleware"]
    added = calls(loop, "app.add_middleware")
    assert [([ast.unparse(a) for a in c.args], c.keywords) for c in added] == [(["imported"], [])]
    module, name = DOOR.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is TokenDoor


def knock(path: str, headers: list | None = None, method: str = "POST") -> tuple[int, bool]:
    """(status, whether the app was reached) of a request (a POST) to path through a TokenDoor that
    vLLM would build: TokenDoor(app), the token from VLLM_API_KEY."""
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
    asyncio.run(TokenDoor(app)(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start"), bool(reached)


def test_token_door_asks_every_route_but_health_for_the_token(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    assert knock("/pause") == (401, False)
    assert knock("/pause", [(b"authorization", b"Bearer wrong")]) == (401, False)
    assert knock("/pause", [(b"authorization", b"Basic secret")]) == (401, False)
    assert knock("/pause", [(b"Authorization", b"Bearer secret")]) == (200, True)
    assert knock("/v1/completions", [(b"authorization", b"Bearer secret")]) == (200, True)
    assert knock("/health") == (200, True)
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        knock("/health")


@pytest.mark.parametrize("version", SUPPORTED)
def test_vllms_own_key_check_lets_options_through_so_the_door_asks_it(vllm, version):
    """vLLM's AuthenticationMiddleware passes every OPTIONS request on unasked (for CORS
    preflights), and /metrics is a mount (prometheus' app answers any method): TokenDoor is what
    keeps an OPTIONS request from reaching them without the token."""
    call = vllm(version).function(MIDDLEWARE + "authenticate.py", "__call__", "AuthenticationMiddleware")
    skips = [n for n in ast.walk(call) if isinstance(n, ast.If) and "scope.get('method') == 'OPTIONS'" in ast.unparse(n.test)]
    assert skips and all(isinstance(n.body[0], ast.Return) for n in skips)
    assert "Mount('/metrics'" in ast.unparse(vllm(version).module(METRICS_ROUTE))


def test_token_door_asks_options_and_every_method_but_for_health(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    for method in ("OPTIONS", "GET", "HEAD", "PUT", "DELETE"):
        assert knock("/metrics", method=method) == (401, False), method
        assert knock("/pause", method=method) == (401, False), method
    assert knock("/v1/completions", [(b"origin", b"http://x"), (b"access-control-request-method", b"POST")],
                 method="OPTIONS") == (401, False)  # a preflight too
    assert knock("/metrics", [(b"authorization", b"Bearer secret")], method="OPTIONS") == (200, True)
    assert knock("/health", method="OPTIONS") == (200, True)


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_launch_flag_is_a_vllm_serve_option(vllm, version):
    src = vllm(version)
    cmd = launch_command("/venv/bin/python", "/models/m", VllmConfig(tp_size=2, max_model_len=4096),
                         host="10.0.0.7", port=8001, seed=7)
    flags = {a: cmd[i + 1] for i, a in enumerate(cmd) if a.startswith("--")}
    assert set(flags) == LAUNCH_FLAGS  # a flag rlctl starts passing needs its check here
    engine = {"--" + f.replace("_", "-") for f in src.class_fields(ARG_UTILS, "EngineArgs")}
    frontend = {"--" + f.replace("_", "-") for f in src.class_fields(src.frontend_args(), "FrontendArgs")}
    assert not LAUNCH_FLAGS - engine - frontend
    # EngineArgs adds its options one by one; FrontendArgs adds each field by the same rule.
    assert not (LAUNCH_FLAGS - frontend) - vllm_source.added_flags(src.function(ARG_UTILS, "add_cli_args", "EngineArgs"))
    rule = "f\"--{key.replace('_', '-')}\""
    assert any(ast.unparse(n) == rule for n in ast.walk(src.module(src.frontend_args())))
    assert flags["--dtype"] in literal_values(src.assignment(ARG_UTILS, "ModelDType"))
    backend = src.class_fields("vllm/config/weight_transfer.py", "WeightTransferConfig")
    assert set(json.loads(flags["--weight-transfer-config"])) <= set(backend)
    assert json.loads(flags["--weight-transfer-config"])["backend"] in literal_values(backend["backend"].annotation)


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_server_runs_as_the_console_script_does(vllm, version):
    src = vllm(version)
    cmd = launch_command("python", "/models/m", VllmConfig(), host="h", port=1, seed=0)
    assert cmd[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert src.entry_points()["vllm"] == "vllm.entrypoints.cli.main:main"
    assert any(isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"
               and [ast.unparse(s) for s in n.body] == ["main()"] for n in src.module(CLI_MAIN).body)
    serve = src.definition(CLI_SERVE, "ServeSubcommand", ast.ClassDef)[1]
    assert "name = 'serve'" in [ast.unparse(s) for s in serve.body]


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_workers_rank_is_offset_plus_its_place_in_the_server(vllm, version):
    rank = vllm(version).worker_group_rank()
    for offset, dp, per_dp, r in [(1, 0, 1, 0), (1, 0, 4, 3), (5, 0, 2, 1), (3, 1, 2, 0), (1, 2, 4, 3)]:
        assert rank(offset, data_parallel_index=dp, world_size=per_dp, rank=r) == offset + dp * per_dp + r


@pytest.mark.parametrize("version", SUPPORTED)
def test_servers_take_consecutive_ranks_after_the_trainer(vllm, version):
    group_layout = vllm_group("group_layout")
    rank = vllm(version).worker_group_rank()
    sizes = [2, 1, 4]
    world, offsets = group_layout(sizes)
    assert offsets == [1 + sum(sizes[:i]) for i in range(len(sizes))] and world == 1 + sum(sizes)
    ranks = [rank(offsets[i], data_parallel_index=0, world_size=n, rank=r) for i, n in enumerate(sizes) for r in range(n)]
    assert sorted(ranks) == list(range(1, world))  # rank 0 is the trainer


@pytest.mark.parametrize("version", SUPPORTED)
def test_vllm_health_checks_its_engine_without_generating(vllm, version):
    """The watch asks vLLM's /health paused or not (rlctl/engines/rollout/adapter.py health_route):
    the handler only awaits check_health(), no request goes to the engine's scheduler."""
    route = vllm(version).route("/health", "GET")
    calls = {ast.unparse(n.func) for n in ast.walk(route.handler) if isinstance(n, ast.Call)}
    assert "client.check_health" in calls and not any("generate" in c for c in calls), calls


SLEEP_ROUTES = {"/sleep": ("POST", {"status", "level"}), "/wake_up": ("POST", {"status", "tags"}),
                "/is_sleeping": ("GET", {"is_sleeping"}), "/release_kv_cache_memory": ("POST", {"status"})}


@pytest.mark.parametrize("version", SUPPORTED)
def test_sleep_mode_routes_are_the_ones_the_client_and_the_emulation_use(vllm, version):
    """vLLM's sleep mode as VllmClient calls it and the built-in server emulates it
    (rlctl/engines/rollout/builtin/vllm_sleep.py): dev routes, their query parameters and bounds,
    their replies, the tags a sleep puts to sleep, and the flag without which no memory moves."""
    from rlctl.engines.rollout.builtin.vllm_sleep import SLEEP_TAGS

    src = vllm(version)
    for path, (method, keys) in SLEEP_ROUTES.items():
        route = src.route(path, method)
        assert route.dev_only, path
        assert src.reply_shapes(path, method) == [Reply(200, "json", frozenset(keys))], path
    params = src.params("/sleep", "POST")
    assert (params["level"].where, params["mode"].where) == ("Query", "Query")
    sleep = src.route("/sleep", "POST").handler
    level = next(a for a in sleep.args.args if a.arg == "level")
    assert ast.unparse(level.annotation) == "Annotated[int, Query(ge=0, le=2)]"
    defaults = dict(zip([a.arg for a in sleep.args.args][-len(sleep.args.defaults):],
                        [ast.literal_eval(d) for d in sleep.args.defaults], strict=True))
    assert (defaults["level"], defaults["mode"]) == (1, "abort")
    wake = ast.unparse(src.route("/wake_up", "POST").handler)
    assert 'raw_request.query_params.getlist("tags")' in wake.replace("'", '"')
    tags = src.assignment("vllm/v1/executor/abstract.py", "SLEEP_TAGS")
    assert set(ast.literal_eval(tags.args[0])) == set(SLEEP_TAGS)
    assert "enable_sleep_mode" in src.class_fields(ARG_UTILS, "EngineArgs")
    # What the emulation refuses and ignores, in the engine core's and executor's own words.
    core, executor = src.function("vllm/v1/engine/core.py", "release_kv_cache_memory", "EngineCore"), \
        ast.unparse(src.module("vllm/v1/executor/abstract.py"))
    refusals = [ast.literal_eval(n.args[0]) for n in ast.walk(core)
                if isinstance(n, ast.Call) and ast.unparse(n.func) == "RuntimeError"]
    assert refusals == ["release_kv_cache_memory() requires a completed pause first",
                        "release_kv_cache_memory() requires all executor memory to be resident"]
    assert "Executor is already sleeping." in executor and "Executor is not sleeping." in executor
    cmd = launch_command("python", "/m", VllmConfig(), host="h", port=1, seed=0, sleep_mode=True)
    assert "--enable-sleep-mode" in cmd
