"""Prometheus metrics with vLLM's names and meanings, prefixed `portaserve:` instead of `vllm:`.

Engine state comes from the engine core's SchedulerStats (sent with every step, and
fetched fresh when /metrics is scraped); per-request timings come from watching each
step's outputs for the requests the server submitted (`track`), so streaming and
non-streaming requests are measured alike:

- gauges `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (a
  fraction, 1 = full, as in vLLM);
- counters `prefix_cache_queries` / `prefix_cache_hits` (tokens), `num_preemptions`,
  `encoder_cache_hits` / `encoder_cache_misses` (images),
  `prompt_tokens`, `generation_tokens`, `request_success` by `finished_reason`;
- histograms `time_to_first_token_seconds`, `inter_token_latency_seconds`,
  `e2e_request_latency_seconds`, `request_queue_time_seconds`;
- `platform_info` (always 1) labelled with the platform, device name and attention backends.

The queue time is estimated in this process: a request is taken to be scheduled when
the step before the one that first reported it ended (or on arrival, if the engine was
idle), because the engine's outputs do not carry the scheduling time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from portaserve.framework.engine.processor import child_request_id

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
PREFIX = "portaserve:"


@dataclass(slots=True)
class _Tracked:
    parent: str
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None


@dataclass(slots=True)
class _Parent:
    num_open: int
    arrival: float
    prompt_counted: bool = False


class ServerMetrics:
    """One server's metrics, in its own registry (several servers can share a process)."""

    def __init__(self, model_name: str, plan: Any | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, lab = self.registry, ["model_name"]

        def gauge(name: str, doc: str, labels=lab) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg)

        def counter(name: str, doc: str, labels=lab) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, lab, buckets=buckets, registry=reg)

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.encoder_hits = counter("encoder_cache_hits", "Images whose encoder output came from the encoder cache.")
        self.encoder_misses = counter("encoder_cache_misses", "Images the vision encoder ran on.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.success = counter("request_success", "Count of successfully processed requests.", lab + ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               LATENCY_BUCKETS)
        # LoRA adapters: requests per adapter, and the workers' loads / evictions / residents
        # speculative decoding (cumulative, from the engine's SchedulerStats)
        self.spec_drafts = counter("spec_decode_num_drafts", "Steps of a request that verified proposals.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.lora_requests = counter("lora_requests", "Requests per LoRA adapter.", lab + ["lora_name"])
        self.lora_loads = gauge("lora_loads", "LoRA adapters written into a slot since start (cumulative).")
        self.lora_evictions = gauge("lora_evictions", "LoRA adapters evicted from their slot since start (cumulative).")
        self.loras_resident = gauge("loras_resident", "LoRA adapters resident in slots now.")
        self.info = Gauge(PREFIX + "platform_info", "The platform, device and attention backends serving this model.",
                          ["model_name", "platform", "device_name", "attention_backend"], registry=reg)
        if plan is not None:
            backends = sorted({choice.name for _, choice in plan.attention})
            self.info.labels(model_name, plan.platform.name, str(getattr(plan.device, "device_name", "")), ",".join(backends)).set(1)
        for g in (self.running, self.waiting, self.kv_usage):
            g.labels(model_name).set(0)
        for c in (self.encoder_hits, self.encoder_misses):
            c.labels(model_name)  # exported as 0 from the start
        self._last: dict[str, int] = {"queries": 0, "hits": 0, "preemptions": 0, "encoder_hits": 0, "encoder_misses": 0,
                                      "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted": 0}
        self._children: dict[str, _Tracked] = {}
        self._parents: dict[str, _Parent] = {}
        self._last_step_end: float | None = None

    # ----- engine state ----------------------------------------------------------------------

    def update_stats(self, stats: Any) -> None:
        """Apply a SchedulerStats snapshot (counters there are cumulative)."""
        if stats is None:
            return
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        for key, counter, value in (
            ("queries", self.prefix_queries, stats.prefix_cache_queries),
            ("hits", self.prefix_hits, stats.prefix_cache_hits),
            ("preemptions", self.preemptions, stats.num_preemptions),
            ("encoder_hits", self.encoder_hits, getattr(stats, "encoder_cache_hits", 0)),
            ("encoder_misses", self.encoder_misses, getattr(stats, "encoder_cache_misses", 0)),
            ("spec_drafts", self.spec_drafts, getattr(stats, "spec_num_drafts", 0)),
            ("spec_draft_tokens", self.spec_draft_tokens, getattr(stats, "spec_num_draft_tokens", 0)),
            ("spec_accepted", self.spec_accepted, getattr(stats, "spec_num_accepted_tokens", 0)),
        ):
            delta = value - self._last[key]
            if delta > 0:
                counter.labels(m).inc(delta)
            self._last[key] = value

    def update_lora_stats(self, stats: dict) -> None:
        m = self.model_name
        for gauge, key in ((self.lora_loads, "lora_loads"), (self.lora_evictions, "lora_evictions"),
                           (self.loras_resident, "loras_resident")):
            gauge.labels(m).set(stats.get(key, 0))

    # ----- requests --------------------------------------------------------------------------

    def track(self, request_id: str, n: int, num_prompt_tokens: int) -> None:
        """Watch a submitted request (before its first step can report it)."""
        now = time.monotonic()
        self._parents[request_id] = _Parent(n, now)
        for i in range(n):
            self._children[child_request_id(request_id, i, n)] = _Tracked(request_id, now, num_prompt_tokens)

    def on_step(self, stats: Any, core_outputs: list) -> None:
        """The engine client's stats listener: one call per engine step."""
        now = time.monotonic()
        m = self.model_name
        self.update_stats(stats)
        num_new = 0
        for out in core_outputs:
            num_new += len(out.new_token_ids)
            child = self._children.get(out.req_id)
            if child is None:
                continue
            parent = self._parents.get(child.parent)
            if out.new_token_ids:
                if child.first_token is None:
                    child.first_token = now
                    self.ttft.labels(m).observe(now - child.arrival)
                    scheduled = child.arrival if self._last_step_end is None else max(child.arrival, self._last_step_end)
                    self.queue.labels(m).observe(scheduled - child.arrival)
                    if parent is not None and not parent.prompt_counted:
                        parent.prompt_counted = True
                        self.prompt_tokens.labels(m).inc(child.num_prompt_tokens)
                else:
                    self.itl.labels(m).observe(now - child.last_token)
                child.last_token = now
            if out.finish_reason is not None:
                self._finish(out.req_id, out.finish_reason, now)
        if num_new:
            self.generation_tokens.labels(m).inc(num_new)
        self._last_step_end = now if stats is None or stats.num_running or stats.num_waiting else None

    def finish_child(self, child_id: str, reason: str) -> None:
        """A completion ended in the front end (a stop string): the engine reports nothing."""
        if child_id in self._children:
            self._finish(child_id, reason, time.monotonic())

    def forget(self, request_id: str, n: int) -> None:
        """Drop a request the engine never accepted (so it is not tracked forever)."""
        self._parents.pop(request_id, None)
        for i in range(n):
            self._children.pop(child_request_id(request_id, i, n), None)

    def _finish(self, child_id: str, reason: str, now: float) -> None:
        child = self._children.pop(child_id)
        self.success.labels(self.model_name, reason).inc()
        parent = self._parents.get(child.parent)
        if parent is None:
            return
        parent.num_open -= 1
        if parent.num_open <= 0:
            del self._parents[child.parent]
            self.e2e.labels(self.model_name).observe(now - parent.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
