"""The rollout section: the servers that generate, and how each request samples."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rlctl.recipe.checks import FieldError, Section, at_most, positive, within
from rlctl.recipe.choices import Device, RolloutEngine, ServerProtocol, SGLangDtype
from rlctl.recipe.multi_turn import MultiTurnConfig

# Flags the sglang engine sets itself (rlctl/engines/rollout/sglang/launch.py).
# --config carries the run's token as the api key (rlctl/process/auth.py); SGLang takes one --config only,
# and an admin key would lock the run's own token out of the weight routes.
SGLANG_MANAGED_FLAGS = ("--model-path", "--host", "--port", "--tp-size", "--tp", "--random-seed", "--api-key",
                        "--mem-fraction-static", "--dtype", "--skip-tokenizer-init", "--dp-size", "--dp",
                        "--base-gpu-id", "--config", "--admin-api-key")

# Flags the vllm engine sets itself (rlctl/engines/rollout/vllm/launch.py). The run's token reaches vLLM
# as VLLM_API_KEY in its environment, and rlctl's own middleware guards the routes vLLM's does not.
VLLM_MANAGED_FLAGS = ("--model", "--host", "--port", "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
                      "--dtype", "--gpu-memory-utilization", "--max-model-len", "--seed", "--api-key",
                      "--weight-transfer-config", "--middleware", "--config")

# Keys a recipe may no longer set: dotted key -> why, and what to do instead. An empty value (the
# old default, in the recipe.yaml of an older run) is dropped without a word.
RETIRED_KEYS = {
    "rollout.sglang.api_key": "removed: the run's own token (the 0600 file `token` in its run directory) is "
                              "every server's api key now; delete this key",
}


# Upper bounds no real run reaches, so that a typo (three zeros too many) is an error and not a
# machine brought down by the processes, requests or memory it asks for.
MAX_SERVERS = 1024
"""rollout.servers: 1024 servers (8,192 GPUs at tp 8) is beyond the largest RL rollout fleets."""
MAX_GROUP_SIZE = 1024
"""rollout.group_size: GRPO groups are 4 to 64 samples."""
MAX_BATCH = 65_536
"""rollout.batch_size (groups), concurrency and max_running_requests (requests per server)."""
MAX_NEW_TOKENS = 1 << 20
"""rollout.sampling.max_new_tokens: 2^20 tokens, 8x the longest context of today's models."""
MAX_TOKEN_ID = (1 << 24) - 1
"""A token id (stop_token_ids) at most: vocabularies are below 2^24 (16.7M) entries."""
MAX_TEMPERATURE = 10.0
"""rollout.sampling.temperature at most: past a few, sampling is uniform noise."""


@dataclass(kw_only=True)
class LongTailConfig(Section):
    """Per-request response lengths drawn from a long-tailed distribution (a benchmark workload).

    Each request gets its own max_new_tokens, and ignore_eos so that it generates exactly that
    many tokens; SGLang supports both per request, so the same workload runs on real SGLang.
    The defaults are shaped like RLVR math: median about 1/10 of the p99, and about 5% of the
    samples producing a third of the tokens (rlctl.workloads.LengthDistribution says how). The
    cap is rollout.sampling.max_new_tokens.
    """

    enabled: bool = False
    """Draw each request's max_new_tokens from this distribution and set ignore_eos; false: every request may
    generate up to rollout.sampling.max_new_tokens and stops at its end of sequence."""
    median_fraction: float = 0.095
    """Median of the lognormal body as a fraction of max_new_tokens."""
    sigma: float = 0.5
    """Log-standard-deviation of the body, in [0, 10]."""
    truncated_fraction: float = 0.05
    """Share of requests that run to max_new_tokens (the runs that hit the length cap)."""
    min_tokens: int = 1
    """The shortest length drawn, at least 1 (at most MAX_NEW_TOKENS)."""
    prompt_share: float = 0.0
    """Share of the lengths' log-variance that belongs to the prompt, in [0, 1): a prompt's samples
    are alike, and so are the same prompt's in later epochs (hard prompts run long and hit the
    cap more often). 0: every sample's length independent of its prompt."""

    def check(self) -> None:
        """Checked enabled or not: a value that cannot work is a typo either way."""
        within("median_fraction", self.median_fraction, 0.0, 1.0, open_low=True, open_high=True)
        within("sigma", self.sigma, 0.0, 10.0)  # e^10: a body wider than any cap
        within("truncated_fraction", self.truncated_fraction, 0.0, 1.0, open_high=True)
        within("min_tokens", self.min_tokens, 1, MAX_NEW_TOKENS)
        within("prompt_share", self.prompt_share, 0.0, 1.0, open_high=True)


@dataclass(kw_only=True)
class SamplingConfig(Section):
    temperature: float = 1.0
    """Sampling temperature, in [0, 10]; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities add up to this (1.0 = all)."""
    top_k: int = -1
    """Sample among the k most likely tokens (-1 = all)."""
    max_new_tokens: int = 8
    """Most tokens a response may have; at most MAX_NEW_TOKENS (2^20)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response, besides the model's end-of-sequence tokens (each below 2^24)."""
    long_tail: LongTailConfig = field(default_factory=LongTailConfig)

    def check(self) -> None:
        within("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        within("top_p", self.top_p, 0.0, 1.0, open_low=True)
        if self.top_k == 0 or self.top_k < -1:
            raise FieldError("top_k", f"must be -1 (all) or >= 1, got {self.top_k}")
        at_most("top_k", self.top_k, MAX_TOKEN_ID + 1, "(a vocabulary's size)")
        positive("max_new_tokens", self.max_new_tokens)
        at_most("max_new_tokens", self.max_new_tokens, MAX_NEW_TOKENS)
        for i, token in enumerate(self.stop_token_ids):
            within(f"stop_token_ids[{i}]", token, 0, MAX_TOKEN_ID)


# The SGLang releases rlctl's adapter speaks, oldest and newest (tests/test_sglang_contract.py
# checks the adapter against the source of each supported release).
SGLANG_OLDEST = (0, 5, 15)
SGLANG_NEWEST = (0, 5, 23)
_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(\.post\d+)?$")


def sglang_release(key: str, text: str) -> tuple[int, int, int]:
    """'0.5.23' -> (0, 5, 23), or a FieldError naming the releases rlctl speaks."""
    m = _RELEASE.match(text)
    spoken = f"{'.'.join(map(str, SGLANG_OLDEST))} .. {'.'.join(map(str, SGLANG_NEWEST))}"
    if m is None or not SGLANG_OLDEST <= (v := tuple(int(x) for x in m.groups()[:3])) <= SGLANG_NEWEST:
        raise FieldError(key, f"'{text}' is not an SGLang release rlctl speaks ({spoken})")
    return v


# The vLLM releases rlctl's adapter speaks, oldest and newest (tests/test_vllm_contract.py checks the
# adapter against the source of each): the first with per-token weight versions in /v1/completions.
VLLM_OLDEST = (0, 33, 0)
VLLM_NEWEST = (0, 34, 0)


def vllm_release(key: str, text: str) -> tuple[int, int, int]:
    """'0.33.0' -> (0, 33, 0), or a FieldError naming the releases rlctl speaks."""
    m = _RELEASE.match(text)
    spoken = f"{'.'.join(map(str, VLLM_OLDEST))} .. {'.'.join(map(str, VLLM_NEWEST))}"
    if m is None or not VLLM_OLDEST <= (v := tuple(int(x) for x in m.groups()[:3])) <= VLLM_NEWEST:
        raise FieldError(key, f"'{text}' is not a vLLM release rlctl speaks ({spoken})")
    return v


@dataclass(kw_only=True)
class BuiltinConfig(Section):
    """rollout.engine=builtin: rlctl's own server (rlctl/engines/rollout/builtin/)."""

    emulate_sglang: str = ""
    """Answer as this SGLang release does (e.g. "0.5.23"): its reply shapes and refusals, its
    routes, and generations stamped "default" until the first weight update. A run checked
    against SGLang's protocol without a GPU; empty = the built-in server's own (the newest)."""
    emulate_vllm: str = ""
    """Answer as this vLLM release's OpenAI server does in dev mode (e.g. "0.34.0"): its routes,
    request and reply shapes, and its weight-transfer group (rendezvous as vLLM's, data over gloo
    where vLLM uses NCCL). The run then drives rlctl's vLLM adapter; empty = SGLang's protocol."""
    tp_size: int = 1
    """Ranks each server takes in the weight-sync group, as an SGLang server with this tensor
    parallelism does (each rank receives every tensor; generation stays on one process). CPU
    servers only: the extra ranks receive over gloo into host memory."""

    def check(self) -> None:
        if self.emulate_sglang:
            sglang_release("emulate_sglang", self.emulate_sglang)
        if self.emulate_vllm:
            vllm_release("emulate_vllm", self.emulate_vllm)
            if self.emulate_sglang:
                raise FieldError("emulate_vllm", "a server speaks one protocol; set emulate_sglang or emulate_vllm")
            if self.tp_size != 1:
                raise FieldError("emulate_vllm", "the vLLM emulation takes one rank per server; set builtin.tp_size=1")
        within("tp_size", self.tp_size, 1, 8)


@dataclass(kw_only=True)
class SGLangConfig(Section):
    """rollout.engine=sglang: how each server is started (python -m sglang.launch_server)."""

    tp_size: int = 1
    """GPUs per server (tensor parallel); data parallel = rollout.servers."""
    mem_fraction_static: float = 0.85
    """Share of each GPU SGLang takes for weights and KV cache (--mem-fraction-static)."""
    dtype: SGLangDtype = SGLangDtype.BFLOAT16
    """Dtype of the server's weights and activations (--dtype); auto = the model's own."""
    skip_tokenizer_init: bool = True
    """rlctl sends token ids and reads output_ids, so the server needs no tokenizer."""
    extra_args: list[str] = field(default_factory=list)
    """Passed through to sglang.launch_server, e.g. ["--attention-backend", "fa3"]."""

    def check(self) -> None:
        positive("tp_size", self.tp_size)
        at_most("tp_size", self.tp_size, 64, "(GPUs per server)")
        within("mem_fraction_static", self.mem_fraction_static, 0.0, 1.0, open_low=True, open_high=True)
        for i, arg in enumerate(self.extra_args):
            if arg.split("=")[0] in SGLANG_MANAGED_FLAGS:
                raise FieldError(f"extra_args[{i}]", f"'{arg}' is set by rlctl; use the rollout.sglang keys or the plan")


@dataclass(kw_only=True)
class VllmConfig(Section):
    """rollout.engine=vllm: how each server is started (vllm serve, in dev mode)."""

    tp_size: int = 1
    """GPUs per server (tensor parallel); data parallel = rollout.servers."""
    gpu_memory_utilization: float = 0.85
    """Share of each GPU vLLM takes for weights, activations and KV cache."""
    max_model_len: int = 0
    """Longest prompt + response a request may have; 0 = the model's own context length."""
    dtype: SGLangDtype = SGLangDtype.BFLOAT16
    """Dtype of the server's weights and activations (--dtype); auto = the model's own."""
    extra_args: list[str] = field(default_factory=list)
    """Passed through to `vllm serve`, e.g. ["--enforce-eager"]."""

    def check(self) -> None:
        positive("tp_size", self.tp_size)
        at_most("tp_size", self.tp_size, 64, "(GPUs per server)")
        within("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, open_low=True)
        within("max_model_len", self.max_model_len, 0, 4 * MAX_NEW_TOKENS)
        for i, arg in enumerate(self.extra_args):
            if arg.split("=")[0] in VLLM_MANAGED_FLAGS:
                raise FieldError(f"extra_args[{i}]", f"'{arg}' is set by rlctl; use the rollout.vllm keys or the plan")


@dataclass(kw_only=True)
class RolloutConfig(Section):
    engine: RolloutEngine = RolloutEngine.BUILTIN
    """builtin (rlctl's own server, CPU or GPU), sglang or vllm."""
    servers: int = 2
    """Rollout servers (data parallel: one per TP group); at most MAX_SERVERS."""
    group_size: int = 8
    """Samples per prompt (G in GRPO); at most MAX_GROUP_SIZE."""
    batch_size: int = 32
    """Groups per rollout batch (B): all generated with one weight version; at most MAX_BATCH."""
    concurrency: int = 32
    """Requests in flight per server under frontier or longest admission (fifo admission sends
    everything); a step with fewer requests than this x servers sends them all at once."""
    max_running_requests: int = 128
    """Largest decode batch a built-in server runs."""
    dynamic_sampling: bool = False
    """Drop complete groups whose rewards are all equal (they carry no GRPO signal)."""
    over_provision: float = 0.0
    """With dynamic sampling: open this fraction more groups than still needed, so that drops do
    not leave the rollout batch waiting for late replacements. Leftovers are aborted."""
    max_gen_batches: int = 10
    """With dynamic sampling: how many rollout batches' worth of groups in a row may be dropped for
    all-equal rewards before the run fails saying so (0: no bound). A policy that has collapsed
    (NaN weights) or a reward that gives every response the same score would otherwise make the
    run draw groups for ever (verl's max_num_gen_batches)."""
    stall_timeout_s: float = 60.0
    """A server whose /health has not answered 200 for this long is lost: its requests go to the
    other servers, and a local one is killed and restarted (rlctl/control/failover.py)."""
    max_restarts: int = 3
    """How often each lost server is started again: locally by the supervisor, under Slurm as a new
    step on its node, in a pool by the pool on its device (0: the run goes on without it)."""
    cpus: list[int] = field(default_factory=list)
    """Pin rollout servers to these CPU cores (empty = no pinning)."""
    device: Device = Device.CPU
    """Where built-in servers run: cpu or cuda (server i uses cuda:i when there are enough GPUs)."""
    gpus: list[int] = field(default_factory=list)
    """Local launcher, device cuda: the GPUs the servers use. Built-in server i runs on
    gpus[i % len] (empty = cuda:i); SGLang server i gets its own tp_size of them, the i-th group
    (empty = all of this machine's), as CUDA_VISIBLE_DEVICES."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    builtin: BuiltinConfig = field(default_factory=BuiltinConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    @property
    def server_tp(self) -> int:
        """GPUs (and weight-sync ranks) each server takes."""
        return {RolloutEngine.SGLANG: self.sglang.tp_size, RolloutEngine.VLLM: self.vllm.tp_size}.get(self.engine, 1)

    @property
    def protocol(self) -> ServerProtocol:
        """The HTTP protocol the servers speak: vLLM's (vLLM servers, or built-in ones emulating
        vLLM) or SGLang's (which the built-in server speaks by default)."""
        vllm = self.engine is RolloutEngine.VLLM or (self.engine is RolloutEngine.BUILTIN and self.builtin.emulate_vllm)
        return ServerProtocol.VLLM if vllm else ServerProtocol.SGLANG

    @property
    def on_gpus(self) -> bool:
        return self.engine is not RolloutEngine.BUILTIN or self.device is Device.CUDA

    def check(self) -> None:
        positive("servers", self.servers)
        at_most("servers", self.servers, MAX_SERVERS)
        if self.group_size < 2:
            raise FieldError("group_size", f"GRPO needs at least 2 samples per group, got {self.group_size}")
        at_most("group_size", self.group_size, MAX_GROUP_SIZE)
        for name in ("batch_size", "concurrency", "max_running_requests"):
            positive(name, getattr(self, name))
            at_most(name, getattr(self, name), MAX_BATCH)
        positive("over_provision", self.over_provision, zero_ok=True)
        at_most("over_provision", self.over_provision, 10.0)
        within("max_gen_batches", self.max_gen_batches, 0, 1_000_000)
        within("stall_timeout_s", self.stall_timeout_s, 1.0, 86400.0)
        within("max_restarts", self.max_restarts, 0, 1000)
        if self.engine is not RolloutEngine.BUILTIN and self.device is not Device.CUDA:
            name = "SGLang" if self.engine is RolloutEngine.SGLANG else "vLLM"
            raise FieldError("device", f"{name} runs on GPUs only; set rollout.device=cuda "
                                       "(or rollout.engine=builtin on CPU)")
        if self.builtin.tp_size > 1 and self.device is not Device.CPU:
            raise FieldError("builtin.tp_size", "the built-in server's extra TP ranks receive on the CPU only; "
                                                "set rollout.device=cpu, or builtin.tp_size=1")
        if any(g < 0 for g in self.gpus):
            raise FieldError("gpus", f"GPU indices are >= 0, got {self.gpus}")
