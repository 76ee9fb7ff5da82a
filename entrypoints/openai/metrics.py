"""Prometheus metrics of one server, in their own registry (so several servers can share a process).

| metric                                              | kind      | what                                        |
|-----------------------------------------------------|-----------|---------------------------------------------|
| fastdeploy_lp:num_requests_running                  | gauge     | sequences in engine slots                   |
| fastdeploy_lp:num_requests_waiting                  | gauge     | sequences waiting for a slot                |
| fastdeploy_lp:time_to_first_token_seconds           | histogram | request arrival → first token               |
| fastdeploy_lp:inter_token_latency_seconds           | histogram | time between a sequence's tokens            |
| fastdeploy_lp:prompt_tokens_total                   | counter   | prompt tokens of admitted requests          |
| fastdeploy_lp:generation_tokens_total               | counter   | generated tokens                            |
| fastdeploy_lp:request_finished_total{finish_reason} | counter   | finished sequences by reason                |
| fastdeploy_lp:logits_processor_seconds_total{processor,phase} | counter | time in update_state / apply |
| fastdeploy_lp:logits_processor_calls_total{processor}| counter  | apply calls                                 |
| fastdeploy_lp:kv_cache_blocks_in_use                | gauge     | KV blocks held by requests                  |
| fastdeploy_lp:kv_cache_blocks_total                 | gauge     | KV blocks in the pool (without the null one)|
| fastdeploy_lp:kv_cache_usage_perc                   | gauge     | blocks in use / total, 0..1                 |
| fastdeploy_lp:prefix_cache_queries_total            | counter   | prompt tokens looked up in the prefix cache |
| fastdeploy_lp:prefix_cache_hits_total               | counter   | of those, found cached                      |
| fastdeploy_lp:prefix_cache_hit_rate                 | gauge     | hits / queries since start                  |
| fastdeploy_lp:num_preemptions_total                 | counter   | requests preempted for KV blocks            |
| fastdeploy_lp:spec_decode_draft_tokens_total{method}    | counter | drafted tokens verified (speculation on)  |
| fastdeploy_lp:spec_decode_accepted_tokens_total{method} | counter | of those, accepted                        |
| fastdeploy_lp:spec_decode_acceptance_rate{method}       | gauge   | accepted / drafted since start            |
| fastdeploy_lp:spec_decode_verify_passes_total{method}   | counter | request-steps that verified drafts        |
| fastdeploy_lp:spec_decode_requests_not_speculating_total{method} | counter | requests that enabled a processor that cannot take part, decoded without drafts |
| fastdeploy_lp:spec_decode_backoffs_total{method}        | counter | pauses requests took because their drafts did not pay |
| fastdeploy_lp:spec_decode_paused_steps_total{method}    | counter | request-steps spent in those pauses       |
| fastdeploy_lp:spec_decode_forced_tokens_total{method}   | counter | tokens a grammar (any processor) forced at draft positions, appended by verify passes |
| fastdeploy_lp:engine_num_requests_running{engine}  | gauge     | per engine (`--data-parallel-size`; one: "0") |
| fastdeploy_lp:engine_num_requests_waiting{engine}  | gauge     | per engine                                  |
| fastdeploy_lp:engine_requests_total{engine}        | counter   | requests each engine was given              |
| fastdeploy_lp:engine_serving{engine}               | gauge     | 1 while the engine serves, 0 once it stopped |

The gauges and counters that request routers and autoscalers read are also served under vLLM's
names, with vLLM's `model_name` label (the served name), so a KEDA trigger, an HPA adapter or
a router's load query written for vLLM works unchanged:

| metric                                                   | same value as                          |
|----------------------------------------------------------|----------------------------------------|
| vllm:num_requests_running{model_name}                    | fastdeploy_lp:num_requests_running     |
| vllm:num_requests_waiting{model_name}                    | fastdeploy_lp:num_requests_waiting     |
| vllm:kv_cache_usage_perc{model_name}                     | fastdeploy_lp:kv_cache_usage_perc      |
| vllm:prefix_cache_queries_total{model_name}              | fastdeploy_lp:prefix_cache_queries_total |
| vllm:prefix_cache_hits_total{model_name}                 | fastdeploy_lp:prefix_cache_hits_total  |
| vllm:num_preemptions_total{model_name}                   | fastdeploy_lp:num_preemptions_total    |

Every labelled metric has the same label names on every replica from the first scrape (the finish
reasons are created at zero), so a router that merges its replicas' scrapes (`sglang-router`'s
/engine_metrics) never sees one metric with two label sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastdeploy_lp.engine.protocol import EngineClient, RequestStream
from fastdeploy_lp.engine.request import FinishReason, RequestOutput

PREFIX = "fastdeploy_lp:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)


class ServerMetrics:
    """Owns the registry; `observe` is the engine's output observer."""

    def __init__(self, engine: EngineClient, model_name: str = ""):
        self.registry = CollectorRegistry()
        r = self.registry
        running = Gauge(PREFIX + "num_requests_running", "Sequences in engine slots.", registry=r)
        running.set_function(lambda: engine.num_running)
        waiting = Gauge(PREFIX + "num_requests_waiting", "Sequences waiting for a free slot.", registry=r)
        waiting.set_function(lambda: engine.num_waiting)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens of a "
                             "sequence.", buckets=_ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter(PREFIX + "request_finished", "Finished sequences by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in FinishReason:
            self.finished.labels(reason.value)
        r.register(_ProcessorTimeCollector(engine))
        r.register(_KVCacheCollector(engine))
        r.register(_SpeculativeCollector(engine))
        r.register(_VLLMNamesCollector(engine, model_name))
        r.register(_EngineLoadCollector(engine))
        self._last_token_time: dict[str, float] = {}

    def observe(self, out: RequestOutput, now: float, stream: RequestStream | None) -> None:
        o = out.outputs
        k = len(o.delta_token_ids)
        rid = out.request_id
        if k:
            self.generation_tokens.inc(k)
            last = self._last_token_time.get(rid)
            if last is None:
                arrival = stream.arrival_time if stream is not None else out.metrics.get("arrival_time", now)
                self.ttft.observe(max(0.0, now - arrival))
                if o.index == 0:
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                for _ in range(k):
                    self.itl.observe((now - last) / k)
            self._last_token_time[rid] = now
        if out.finished:
            self._last_token_time.pop(rid, None)
            self.finished.labels(o.finish_reason or "unknown").inc()


class _ProcessorTimeCollector:
    """Per-processor time, read from `processor_timings()` at scrape time."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        seconds = CounterMetricFamily(PREFIX + "logits_processor_seconds", "Time spent in each logits processor.",
                                      labels=["processor", "phase"])
        calls = CounterMetricFamily(PREFIX + "logits_processor_calls", "apply() calls of each logits processor.",
                                    labels=["processor"])
        for name, t in self.engine.processor_timings().items():
            seconds.add_metric([name, "update_state"], t.get("update_state_seconds", 0.0))
            seconds.add_metric([name, "apply"], t.get("apply_seconds", 0.0))
            calls.add_metric([name], t.get("calls", 0))
        yield seconds
        yield calls


class _KVCacheCollector:
    """Block pool and prefix-cache counters, read at scrape time."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        stats = self.engine.kv_cache_stats()
        for name, doc, value in (
                ("kv_cache_blocks_in_use", "KV cache blocks held by requests.", stats.blocks_in_use),
                ("kv_cache_blocks_total", "KV cache blocks in the pool.", stats.blocks_total),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use.", stats.usage),
                ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.",
                 stats.prefix_hit_rate)):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queried_tokens),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens),
                ("num_preemptions", "Requests preempted to free KV cache blocks.", stats.preemptions)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class _SpeculativeCollector:
    """Speculative decoding's counters per method, read at scrape time (nothing when it is off)."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        stats = self.engine.speculative_stats()
        if stats["method"] is None:
            return
        for name, doc, key, family in (
                ("spec_decode_draft_tokens", "Drafted tokens verified.", "drafted_tokens", CounterMetricFamily),
                ("spec_decode_accepted_tokens", "Drafted tokens accepted.", "accepted_tokens", CounterMetricFamily),
                ("spec_decode_acceptance_rate", "Accepted / drafted tokens since start.", "acceptance_rate",
                 GaugeMetricFamily),
                ("spec_decode_verify_passes", "Request-steps that verified drafts.", "verify_passes",
                 CounterMetricFamily),
                ("spec_decode_requests_not_speculating", "Requests that enabled a logits processor that cannot "
                 "take part in speculative decoding (they decode without drafts).", "requests_not_speculating",
                 CounterMetricFamily),
                ("spec_decode_backoffs", "Pauses requests took because their drafts did not pay.", "backoffs",
                 CounterMetricFamily),
                ("spec_decode_paused_steps", "Request-steps spent in those pauses.", "paused_steps",
                 CounterMetricFamily),
                ("spec_decode_forced_tokens", "Tokens processors forced at draft positions, appended by "
                 "verify passes.", "forced_tokens", CounterMetricFamily)):
            yield _family(PREFIX + name, doc, family, "method", {stats["method"]: stats[key]})


class _VLLMNamesCollector:
    """The load and cache figures routers and autoscalers read, under vLLM's names and label."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.kv_cache_stats()
        for name, doc, value, family in (
                ("num_requests_running", "Requests in engine slots.", self.engine.num_running, GaugeMetricFamily),
                ("num_requests_waiting", "Requests waiting for a slot.", self.engine.num_waiting, GaugeMetricFamily),
                ("kv_cache_usage_perc", "KV cache usage, 0..1.", stats.usage, GaugeMetricFamily),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queried_tokens,
                 CounterMetricFamily),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens,
                 CounterMetricFamily),
                ("num_preemptions", "Requests preempted.", stats.preemptions, CounterMetricFamily)):
            yield _family("vllm:" + name, doc, family, "model_name", {self.model_name: value})


class _EngineLoadCollector:
    """Each engine's load (`EngineClient.engine_loads`), labelled by its rank."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        loads = self.engine.engine_loads()
        for name, doc, key, family in (
                ("engine_num_requests_running", "Sequences in this engine's slots.", "num_running_reqs",
                 GaugeMetricFamily),
                ("engine_num_requests_waiting", "Sequences waiting for this engine.", "num_waiting_reqs",
                 GaugeMetricFamily),
                ("engine_requests", "Requests given to this engine.", "num_requests_total", CounterMetricFamily),
                ("engine_serving", "1 while this engine serves.", "serving", GaugeMetricFamily)):
            yield _family(PREFIX + name, doc, family, "engine", {str(load["engine"]): load[key] for load in loads})


def _family(name: str, doc: str, family, label: str, values: dict[str, float]):
    """A metric family of one label, a sample per `values` entry (label value -> value)."""
    metric = family(name, doc, labels=[label])
    for label_value, value in values.items():
        metric.add_metric([label_value], float(value))
    return metric
