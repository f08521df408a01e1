"""tests/sglang_source.py, the reader of SGLang's own source, checked against facts read by hand
from the wheels of the supported versions: if the reader misreads SGLang, these fail before any
contract test leans on it. Needs the wheels ($RLCTL_SGLANG_WHEELS or ~/.cache/rlctl/sglang-wheels);
a missing one is fetched once with pip, and without it the tests skip (fail under CI)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

import sglang_source as sgl
from sglang_memory import answers_null, memory_step, memory_tags
from sglang_source import SUPPORTED, Field, MissingWheel, Reply, Source

SESSIONS = ("0.5.21", "0.5.23")  # the versions with /begin_weight_update and /end_weight_update
# The routes rlctl's client uses (docs/sglang.md) and the method it uses them with.
RELIED_ON = {
    "/health": "GET", "/server_info": "GET", "/model_info": "GET",
    "/generate": "POST", "/abort_request": "POST", "/pause_generation": "POST",
    "/continue_generation": "POST", "/flush_cache": "POST", "/init_weights_update_group": "POST",
    "/update_weights_from_distributed": "POST", "/update_weight_version": "POST",
    "/destroy_weights_update_group": "POST", "/update_weights_from_tensor": "POST",
}
SESSION_ROUTES = {"/begin_weight_update": "POST", "/end_weight_update": "POST"}
CONTROL = frozenset({"success", "message"})
ERROR = frozenset({"error"})

# -- the wheels and their routes ------------------------------------------------------------------

@pytest.mark.parametrize("version", SUPPORTED)
def test_each_wheel_is_the_version_it_is_named(sglang, version):
    assert sglang(version).version == version


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_routes_rlctl_uses_exist_with_their_methods(sglang, version):
    routes = sglang(version).routes()
    relied = RELIED_ON | (SESSION_ROUTES if version in SESSIONS else {})
    missing = {path: method for path, method in relied.items() if method not in routes.get(path, ())}
    assert not missing
    assert routes["/flush_cache"] == {"GET", "POST"} and routes["/generate"] == {"POST", "PUT"}


@pytest.mark.parametrize("version", SUPPORTED)
def test_weight_update_sessions_arrive_in_0_5_21(sglang, version):
    routes = sglang(version).routes()
    assert ("/begin_weight_update" in routes) == (version in SESSIONS)
    assert ("/end_weight_update" in routes) == (version in SESSIONS)


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_route_whose_path_is_computed_is_skipped(sglang, version):
    # @app.post(os.environ.get("SGLANG_OLLAMA_CHAT_ROUTE", "/api/chat"))
    src = sglang(version)
    assert any(isinstance(n, ast.AsyncFunctionDef) and n.name == "ollama_chat" for n in ast.walk(src.module(sgl.HTTP_SERVER)))
    assert "/api/chat" not in src.routes()


@pytest.mark.parametrize("version", SUPPORTED)
def test_each_route_names_the_request_struct_it_takes(sglang, version):
    src = sglang(version)
    assert src.route_request_struct("/generate") == "GenerateReqInput"  # obj: GenerateReqInput
    assert src.route_request_struct("/abort_request") == "AbortReq"  # obj: Annotated[AbortReq, Body()]
    assert src.route_request_struct("/update_weights_from_distributed") == "UpdateWeightsFromDistributedReqInput"
    assert src.route_request_struct("/pause_generation") == "PauseGenerationReqInput"
    assert src.route_request_struct("/flush_cache") is None  # flush_cache(timeout: float = Query(...))
    assert src.handler("/health").name == "health_generate"


# -- request structs, sampling parameters, server arguments -------------------------------------

@pytest.mark.parametrize("version", SUPPORTED)
def test_a_weight_bucket_announcement_has_the_fields_rlctl_sends(sglang, version):
    fields = sglang(version).struct_fields("UpdateWeightsFromDistributedReqInput")
    assert fields["names"] == Field("List[str]", None)
    assert fields["shapes"] == Field("List[List[int]]", None)
    assert fields["dtypes"].default is None
    defaults = {name: ast.literal_eval(fields[name].default) for name in
                ("group_name", "flush_cache", "abort_all_requests", "weight_version", "load_format")}
    assert defaults == {"group_name": "weight_update_group", "flush_cache": True, "abort_all_requests": False,
                        "weight_version": None, "load_format": None}
    assert fields["rid"] == Field("Optional[str]", "None")  # from BaseReq


@pytest.mark.parametrize("version", SUPPORTED)
def test_other_request_structs(sglang, version):
    src = sglang(version)
    group = src.struct_fields("InitWeightsUpdateGroupReqInput")
    assert {name for name, f in group.items() if f.default is None} == {
        "master_address", "master_port", "rank_offset", "world_size"}
    assert (group["group_name"].default, group["backend"].default) == ("'weight_update_group'", "'nccl'")
    version_req = src.struct_fields("UpdateWeightVersionReqInput")
    assert version_req["new_version"].default is None
    assert version_req["abort_all_requests"].default == "True"  # rlctl sends false explicitly
    assert src.struct_fields("AbortReq")["abort_all"].default == "False"
    assert src.struct_fields("PauseGenerationReqInput")["mode"] == Field(
        "Literal['abort', 'retract', 'in_place']", "'abort'")


@pytest.mark.parametrize("version", SUPPORTED)
def test_sampling_params_take_every_key_docs_sglang_md_lists(sglang, version):
    documented = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                  "ignore_eos", "skip_special_tokens", "no_stop_trim", "n", "sampling_seed"}
    assert documented <= sglang(version).sampling_params()


@pytest.mark.parametrize("version", SUPPORTED)
def test_server_args_defaults(sglang, version):
    src = sglang(version)
    assert ast.literal_eval(src.server_args_default("weight_version")) == "default"
    assert src.server_args_default("tp_size") == "1"
    assert src.server_args_default("base_gpu_id") == "0"
    assert {"model_path", "tp_size", "dp_size", "random_seed", "skip_tokenizer_init", "api_key"} <= src.server_args_fields()


# -- replies ------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", SUPPORTED)
@pytest.mark.parametrize("path", ["/pause_generation", "/continue_generation"])
def test_pause_and_continue_answer_without_a_success_key(sglang, version, path):
    assert sglang(version).reply_shapes(path) == [Reply(200, "json", frozenset({"message", "status"}))]


@pytest.mark.parametrize("version", SUPPORTED)
def test_weight_update_routes_answer_success_and_message(sglang, version):
    src = sglang(version)
    paths = ["/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
             "/update_weights_from_tensor"]
    for path in paths + (list(SESSION_ROUTES) if version in SESSIONS else []):
        assert src.reply_shapes(path) == [Reply(200, "json", CONTROL), Reply(400, "json", CONTROL)], path
    assert src.reply_shapes("/update_weight_version") == [
        Reply(200, "json", CONTROL | {"new_version"}), Reply(400, "json", CONTROL)]


@pytest.mark.parametrize("version", SUPPORTED)
def test_flush_abort_and_health_replies(sglang, version):
    src = sglang(version)
    assert src.reply_shapes("/flush_cache") == [Reply(200, "text"), Reply(400, "text")]
    assert src.reply_shapes("/health") == [Reply(503, "empty"), Reply(200, "empty")]
    # abort: an empty 200, or _create_error_response(e) where the call raises
    error_status = 400 if version == "0.5.15.post1" else "getattr(e, 'status_code', HTTPStatus.BAD_REQUEST)"
    assert src.reply_shapes("/abort_request") == [Reply(200, "empty"), Reply(error_status, "json", ERROR)]


@pytest.mark.parametrize("version", SUPPORTED)
def test_generate_answers_its_output_a_stream_or_an_error(sglang, version):
    kinds = {(r.status, r.kind) for r in sglang(version).reply_shapes("/generate")}
    assert {(200, "stream"), (200, "passthrough")} <= kinds
    assert all(r.keys == ERROR for r in sglang(version).reply_shapes("/generate") if r.kind == "json")


@pytest.mark.parametrize("version", SUPPORTED)
def test_info_replies_have_the_keys_rlctl_reads(sglang, version):
    src = sglang(version)
    [model_info] = src.reply_shapes("/model_info")
    assert model_info.kind == "json" and not model_info.unresolved
    assert {"model_path", "weight_version", "is_generation"} <= model_info.keys
    [server_info] = src.reply_shapes("/server_info")
    assert server_info.kind == "json" and server_info.unresolved == ("_global_state.scheduler_info",)
    assert src.server_args_fields() | {"version", "internal_states"} <= server_info.keys
    assert "weight_update_session" not in server_info.keys  # the built-in server's key only


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_reply_of_a_route_rlctl_uses_is_classified(sglang, version):
    src = sglang(version)
    for path in RELIED_ON | (SESSION_ROUTES if version in SESSIONS else {}):
        assert [r for r in src.reply_shapes(path) if r.kind == "unknown"] == [], path


# -- memory occupation (tests/sglang_memory.py) ---------------------------------------------------

@pytest.mark.parametrize("version", SUPPORTED)
def test_memory_routes_take_tags_and_answer_null_or_an_error(sglang, version):
    src = sglang(version)
    error_status = 400 if version == "0.5.15.post1" else "getattr(e, 'status_code', HTTPStatus.BAD_REQUEST)"
    for path, struct in (("/release_memory_occupation", "ReleaseMemoryOccupationReqInput"),
                         ("/resume_memory_occupation", "ResumeMemoryOccupationReqInput")):
        assert src.routes()[path] == {"GET", "POST"}  # @app.api_route(path, methods=["GET", "POST"])
        assert src.route_request_struct(path) == struct  # obj: Annotated[X, Body()]
        assert src.struct_fields(struct)["tags"] == Field("Optional[List[str]]", "None")
        for method in ("GET", "POST"):  # try: await ...; except Exception as e: return _create_error_response(e)
            assert src.reply_shapes(path, method) == [Reply(error_status, "json", ERROR)]
            assert answers_null(src, path, method)
    assert memory_tags(src) == ["kv_cache", "weights", "cuda_graph"]


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_release_asserts_an_idle_server_and_a_resume_removes_released_tags(sglang, version):
    src = sglang(version)
    release, resume = memory_step(src, "release_memory_occupation"), memory_step(src, "resume_memory_occupation")
    assert release.idle_message == "release_memory_occupation should be called only when server is idle."
    assert release.idle_check == ("self.is_fully_idle()" if version == "0.5.15.post1" else
                                  "self.is_fully_idle(ignore_waiting=scheduler is not None and scheduler._engine_paused)")
    assert release.all_tags_when == resume.all_tags_when == "tags is None or len(tags) == 0"
    assert release.bookkeeping == "self.offload_tags.add(tag)"
    assert resume.bookkeeping == "self.offload_tags.remove(tag)"  # KeyError for a tag not released
    assert resume.idle_check is None


def test_the_reader_tells_a_handler_that_falls_off_its_end(tmp_path):
    src = source_tree(tmp_path, '''
@app.post("/silent")
async def silent(obj: X):
    try:
        await do(obj)
    except Exception as e:
        return error(e)

@app.post("/always")
async def always(obj: X):
    if obj.a:
        return 1
    else:
        raise HTTPException(400)

@app.post("/loud")
async def loud(obj: X):
    try:
        return await do(obj)
    except Exception as e:
        return error(e)
''')
    assert [answers_null(src, p) for p in ("/silent", "/always", "/loud")] == [True, False, False]


# -- weight updates -----------------------------------------------------------------------------

@pytest.mark.parametrize("version", SUPPORTED)
def test_each_tp_rank_joins_the_weight_update_group_at_rank_offset_plus_tp_rank(sglang, version):
    assert sglang(version).weight_update_rank() == "rank_offset + self.tp_rank"


@pytest.mark.parametrize("version", SUPPORTED)
def test_updates_outside_a_session_are_refused_before_any_tensor_is_received(sglang, version):
    refusal = sglang(version).update_refused_outside_session()
    if version not in SESSIONS:
        assert refusal is None
        return
    assert refusal.message == ("update_weights_from_distributed must run between "
                               "begin_weight_update() and end_weight_update()")
    assert refusal.before_receive


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_flattened_bucket_is_its_tensors_bytes_back_to_back(sglang, version):
    bucket_class = sglang(version).flattened_tensor_bucket()
    tensors = [("f", torch.randn(3)), ("h", torch.randn(5, dtype=torch.float32).to(torch.bfloat16)),
               ("b", torch.arange(3, dtype=torch.int8))]
    bucket = bucket_class(named_tensors=tensors)
    raw = torch.cat([t.flatten().view(torch.uint8) for _, t in tensors])
    assert bucket.get_flattened_tensor().dtype == torch.uint8
    assert torch.equal(bucket.get_flattened_tensor(), raw)  # 12 + 10 + 3 bytes, no padding
    assert [(m.start_idx, m.end_idx) for m in bucket.get_metadata()] == [(0, 12), (12, 22), (22, 25)]
    for (name, tensor), (got_name, got) in zip(tensors, bucket.reconstruct_tensors()):
        assert name == got_name and torch.equal(tensor, got)


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_tensor_at_an_unaligned_offset_cannot_be_read_back(sglang, version):
    bucket_class = sglang(version).flattened_tensor_bucket()
    tensors = [("b", torch.ones(3, dtype=torch.int8)), ("f", torch.ones(2))]  # f at byte 3
    with pytest.raises(RuntimeError, match="divisible by 4"):
        bucket_class(named_tensors=tensors).reconstruct_tensors()
    if hasattr(bucket_class, "empty"):  # the receiving side, 0.5.23 on: refused before allocating
        with pytest.raises(ValueError, match="Unaligned"):
            bucket_class.empty(["b", "f"], ["int8", "float32"], [[3], [2]], "cpu")


# -- the reader itself --------------------------------------------------------------------------

def handler_text(src: Source, path: str) -> str:
    func = src.handler(path)
    lines = (src.root / sgl.HTTP_SERVER).read_text().splitlines()
    return "\n".join(lines[func.decorator_list[0].lineno - 1:func.end_lineno]) + "\n"


def source_tree(root: Path, http_server: str) -> Source:
    path = root / sgl.HTTP_SERVER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(http_server)
    return Source(root)


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_changed_reply_is_noticed(sglang, version, tmp_path):
    original = handler_text(sglang(version), "/pause_generation")
    assert original.count('"status": "ok"') == 1
    changed = source_tree(tmp_path, original.replace('"status": "ok"', '"success": True'))
    assert changed.reply_shapes("/pause_generation") == [Reply(200, "json", frozenset({"message", "success"}))]
    assert changed.reply_shapes("/pause_generation") != sglang(version).reply_shapes("/pause_generation")


def test_what_the_reader_cannot_classify_it_says_so(tmp_path):
    src = source_tree(tmp_path, '''
@app.post("/odd")
async def odd(obj: Annotated[Odd, Body()]):
    if obj.a:
        return make_some_response(obj)
    if obj.b:
        return [1, 2]
    payload = {"a": 1, **obj.extra}
    payload["b"] = 2
    return ORJSONResponse(payload, status_code=HTTPStatus.ACCEPTED if obj.c else code)

@app.api_route("/plain", methods=["GET", "PUT"])
def plain():
    return Response("ok", 200, media_type="application/json")
''')
    assert src.routes() == {"/odd": {"POST"}, "/plain": {"GET", "PUT"}}
    assert src.route_request_struct("/odd") == "Odd"
    assert src.reply_shapes("/odd") == [
        Reply(200, "unknown", unresolved=("make_some_response(obj)",)),
        Reply(200, "unknown", unresolved=("[1, 2]",)),
        Reply(202, "json", frozenset({"a", "b"}), ("obj.extra",)),
        Reply("code", "json", frozenset({"a", "b"}), ("obj.extra",)),
    ]
    assert [r.kind for r in src.reply_shapes("/plain")] == ["unknown"]


# -- wheels and extraction ----------------------------------------------------------------------

def test_a_missing_wheel_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_SGLANG_WHEELS", str(tmp_path))
    with pytest.raises(MissingWheel, match=r"pip download --no-deps .*sglang==0\.5\.23"):
        sgl.wheel("0.5.23")


def test_extraction_is_idempotent_and_safe_to_race(sglang, tmp_path, monkeypatch):
    sglang("0.5.23")
    monkeypatch.setenv("RLCTL_SGLANG_SRC", str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(sgl.extract(sgl.wheel("0.5.23")))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no partial folder left
    assert sgl.extract(sgl.wheel("0.5.23")) == results[0]
    assert Source(results[0]).reply_shapes("/pause_generation") == sglang("0.5.23").reply_shapes("/pause_generation")
