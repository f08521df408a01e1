"""The built-in server's generation engine: a transformers causal LM with continuous batching.

One scheduler thread owns the model. Each iteration it admits waiting requests (up to
max_running_requests), prefills the new ones, runs one decode step for every running request,
samples a token per request with that request's own sampling parameters, and hands finished
requests back to the event loop. Requests join and leave the batch between steps, so a short
answer returns as soon as it is done, not when the longest one in its batch is.

The running requests share one left-padded KV cache, a row per request. A decode step runs
every row at once and the cache grows by one column; rows of finished requests are dropped and
newly prefilled requests are appended as rows between steps, by a few whole-tensor operations per
layer, so a step's bookkeeping does not grow with the number of requests (on a GPU, per-request
copies made the step launch-bound long before the model was). The attention mask hides the
padding, and positions count real tokens only, so a token gets the same position (and log-prob)
as in the trainer's right-padded forward pass.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch

log = logging.getLogger("rlctl.rollout")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Accepted for protocol compatibility; these have no effect on token-id requests.
    stop: list[str] | str | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a request body, raising TypeError/ValueError on bad fields (-> HTTP 400)."""
        if not isinstance(data, dict):
            raise TypeError("sampling_params must be an object")
        known = cls.__dataclass_fields__
        unknown = set(data) - set(known)
        if unknown:
            raise TypeError(f"unknown sampling params: {sorted(unknown)}")
        p = cls(**data)
        for name, _typ in (("max_new_tokens", int), ("top_k", int), ("n", int)):
            v = getattr(p, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name} must be an integer, got {v!r}")
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(p, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"{name} must be a number, got {v!r}")
        if not isinstance(p.stop_token_ids, list) or not all(isinstance(t, int) for t in p.stop_token_ids):
            raise TypeError("stop_token_ids must be a list of integers")
        if not isinstance(p.ignore_eos, bool):
            raise TypeError("ignore_eos must be a boolean")
        if p.max_new_tokens < 0 or p.temperature < 0 or not 0 < p.top_p <= 1 or p.n != 1:
            raise ValueError("max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1 and n == 1 are required")
        return p


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    done: Callable[[Request], None]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    created: float = field(default_factory=time.monotonic)


class BatchCache:
    """The KV cache of the running requests: per layer (keys, values) [rows, kv_heads, columns,
    head_dim], left-padded, holding each request's tokens but the last one sampled. `lengths[i]`
    is row i's real token count; its tokens are the last lengths[i] columns."""

    def __init__(self) -> None:
        self.rows: list[Request] = []
        self.lengths: list[int] = []
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def columns(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def keep(self, alive: set[int]) -> None:
        """Drop the rows whose request is not in `alive` (ids), then the columns no row uses."""
        idx = [i for i, r in enumerate(self.rows) if id(r) in alive]
        if len(idx) == len(self.rows):
            return
        if not idx:
            self.rows, self.lengths, self.layers = [], [], []
            return
        self.rows = [self.rows[i] for i in idx]
        self.lengths = [self.lengths[i] for i in idx]
        sel = torch.tensor(idx, device=self.layers[0][0].device)
        cut = self.columns - max(self.lengths)
        for i, (k, v) in enumerate(self.layers):  # layer by layer: one layer's copy at a time
            self.layers[i] = (k.index_select(0, sel)[:, :, cut:], v.index_select(0, sel)[:, :, cut:])

    def append(self, rows: list[Request], lengths: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add rows (a prefilled batch, left-padded the same way) below the existing ones."""
        if not self.rows:
            self.rows, self.lengths, self.layers = list(rows), list(lengths), layers
            return
        width = max(self.columns, layers[0][0].shape[2])

        def left_pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))

        for i, ((k0, v0), (k1, v1)) in enumerate(zip(self.layers, layers, strict=True)):  # one layer's copy at a time
            self.layers[i] = (torch.cat([left_pad(k0), left_pad(k1)]), torch.cat([left_pad(v0), left_pad(v1)]))
        self.rows += rows
        self.lengths += lengths


class Engine:
    def __init__(self, model, eos_token_ids: set[int], pad_token_id: int, max_running: int, seed: int,
                 max_context: int, weight_version: str = "0") -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.max_running = max_running
        self.max_context = max_context
        self.weight_version = weight_version
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused = False
        self.held = False
        """Memory released (or on its way out or back): no step runs, whatever pause says."""
        self.cond = threading.Condition()
        # Held for each decode step and for each weight load: weights never change mid-step.
        self.model_lock = threading.Lock()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        # transformers 5.2x renamed the forward argument past_key_values to cache.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.tokens_generated = 0
        self.last_output = time.monotonic()
        """When the scheduler last finished a step (what SGLang's /health_generate waits for)."""
        self.cache = BatchCache()  # only the scheduler thread touches it (and drop_cache, when no step can run)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self.thread.join(timeout=5)

    # -- called from the event loop ------------------------------------------------------------

    def submit(self, req: Request) -> None:
        with self.cond:
            self.waiting.append(req)
            self.cond.notify_all()

    def abort(self, rid: str | None, abort_all: bool = False) -> int:
        with self.cond:
            victims = [r for r in self.waiting + self.running if abort_all or r.rid == rid]
            for r in victims:
                r.finish_reason = {"type": "abort", "message": "aborted by request"}
            self.waiting = [r for r in self.waiting if r.finish_reason is None]
            self.running = [r for r in self.running if r.finish_reason is None]
        for r in victims:
            r.done(r)
        return len(victims)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None, abort_all=True)
        with self.cond:
            self.paused = True

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def hold(self, on: bool) -> None:
        """Keep the scheduler from stepping while the model's memory is released (requests
        already waiting stay queued for after the resume)."""
        with self.cond:
            self.held = on
            self.cond.notify_all()

    def idle_for_release(self, waiting_ok_when_paused: bool) -> bool:
        """Nothing running, and nothing waiting unless generation is paused (SGLang 0.5.21 on
        releases memory with requests queued behind a pause; 0.5.15 wants no request at all)."""
        with self.cond:
            return not self.running and (not self.waiting or (waiting_ok_when_paused and self.paused))

    def cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.cache.layers)

    def drop_cache(self) -> None:
        """Free the KV cache rows still held (those of requests aborted while no step ran since).
        The caller holds model_lock with the scheduler held (hold()), so no step is using them."""
        self.cache = BatchCache()

    def load(self) -> dict[str, int]:
        with self.cond:
            return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                    "num_generated_tokens": self.tokens_generated}

    @property
    def idle(self) -> bool:
        with self.cond:
            return not self.running and not self.waiting

    # -- scheduler thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        """The scheduler. A step that raises (out of memory, a broken model) ends the whole
        process, as SGLang's scheduler ends its server: a server whose HTTP side outlived its
        engine would hold its requests until a watchdog noticed; a dead one is seen at once,
        and restarted by its supervisor."""
        try:
            self._schedule()
        except BaseException:  # noqa: BLE001 - said in the log, then the process ends
            log.exception("the scheduler thread failed; this server exits")
            logging.shutdown()
            os._exit(1)

    def _schedule(self) -> None:
        while True:
            with self.cond:
                while not self._stop and (self.paused or self.held or not (self.waiting or self.running)):
                    self.cond.wait()
                if self._stop:
                    return
                room = self.max_running - len(self.running)
                self.running.extend(self.waiting[:room])
                del self.waiting[:room]
                batch = list(self.running)
            with self.model_lock:
                finished = self._step(batch)
            self.last_output = time.monotonic()
            if finished:
                with self.cond:
                    self.running = [r for r in self.running if r.finish_reason is None]
                for r in finished:
                    r.done(r)

    @torch.no_grad()
    def _step(self, batch: list[Request]) -> list[Request]:
        finished: list[Request] = []
        active = []
        for r in batch:
            if r.finish_reason is not None:
                continue  # aborted meanwhile
            if r.params.max_new_tokens == 0 or len(r.input_ids) >= self.max_context:
                self._finish(r, {"type": "length", "length": len(r.output_ids)}, finished)
            else:
                active.append(r)
        self.cache.keep({id(r) for r in active})  # finished and aborted requests leave the cache
        cached = {id(r) for r in self.cache.rows}
        new = [r for r in active if id(r) not in cached]
        stepped: list[Request] = []
        logits = []
        if self.cache.rows:
            stepped += self.cache.rows
            logits.append(self._decode())
        if new:
            logits.append(self._prefill(new))
            stepped += new
        if not stepped:
            return finished
        tokens, logprobs = self._sample(torch.cat(logits), stepped)
        for r, tok, lp in zip(stepped, tokens.tolist(), logprobs.tolist()):
            if r.finish_reason is not None:
                continue  # aborted during the step
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.weight_version = self.weight_version
            self.tokens_generated += 1
            total = len(r.input_ids) + len(r.output_ids)
            if not r.params.ignore_eos and tok in self.eos_token_ids:
                self._finish(r, {"type": "stop", "matched": tok}, finished)
            elif tok in r.params.stop_token_ids:
                self._finish(r, {"type": "stop", "matched": tok}, finished)
            elif len(r.output_ids) >= r.params.max_new_tokens or total >= self.max_context:
                self._finish(r, {"type": "length", "length": len(r.output_ids)}, finished)
        if finished:  # free their cache rows at once
            self.cache.keep({id(r) for r in self.cache.rows if r.finish_reason is None})
        return finished

    def _prefill(self, reqs: list[Request]) -> torch.Tensor:
        """Run whole sequences (left-padded), add them to the batch cache, return last logits."""
        seqs = [r.input_ids + r.output_ids for r in reqs]
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, length - len(s):] = torch.tensor(s)
            mask[i, length - len(s):] = 1
        # Positions count real tokens only, so left padding does not shift them: the trainer
        # (right padding) sees the same positions for the same tokens.
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.cache.append(reqs, [len(s) for s in seqs], _layers_of(out))
        return out.logits[:, -1].float()

    def _decode(self) -> torch.Tensor:
        """One token for every row of the batch cache: each row's last sampled token at position
        = its cached length, attending to its own columns only."""
        from transformers import DynamicCache

        cache = self.cache
        columns = cache.columns
        lengths = torch.tensor(cache.lengths, device=self.device)
        mask = (torch.arange(columns + 1, device=self.device)[None, :] >= (columns - lengths)[:, None]).long()
        ids = torch.tensor([[r.output_ids[-1] if r.output_ids else r.input_ids[-1]] for r in cache.rows], device=self.device)
        # The DynamicCache copies what it is given: it is filled layer by layer, each layer let go
        # of once copied, and then holds the only reference, so each layer's old keys and values
        # are freed as soon as it has appended the new column. The step so needs one layer's copy
        # at a time, not the whole cache's.
        past = DynamicCache()
        for i in range(len(cache.layers)):
            past.update(*cache.layers[i], i)
            cache.layers[i] = None
        cache.layers = []
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=lengths[:, None], use_cache=True,
                         logits_to_keep=1, **{self._cache_arg: past})
        del past
        cache.layers = _layers_of(out)
        cache.lengths = [n + 1 for n in cache.lengths]
        return out.logits[:, -1].float()

    @staticmethod
    def _finish(r: Request, reason: dict[str, Any], finished: list[Request]) -> None:
        r.finish_reason = reason
        finished.append(r)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row with that row's temperature/top-k/top-p/min-p; logprob under T."""
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
        logprobs_all = torch.log_softmax(scaled, dim=-1)
        probs = logprobs_all.exp()
        for i, r in enumerate(reqs):
            p = r.params
            if p.top_k > 0 and p.top_k < probs.shape[1]:
                kth = probs[i].topk(p.top_k).values[-1]
                probs[i][probs[i] < kth] = 0
            if p.top_p < 1.0:
                sorted_p, idx = probs[i].sort(descending=True)
                cum = sorted_p.cumsum(0)
                drop = cum - sorted_p > p.top_p
                probs[i][idx[drop]] = 0
            if p.min_p > 0:
                probs[i][probs[i] < p.min_p * probs[i].max()] = 0
        sampled = torch.multinomial(probs / probs.sum(1, keepdim=True), 1, generator=self.generator).squeeze(1)
        tokens = torch.where(greedy, logits.argmax(-1), sampled)
        return tokens, logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _layers_of(out) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = getattr(out, "cache", None)
    cache = cache if cache is not None else out.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def future_callback(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Callable[[Request], None]:
    """A `done` callback that completes an asyncio future from the scheduler thread."""

    def done(req: Request) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

    return done
