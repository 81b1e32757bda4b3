"""Prometheus export of the router's metrics (optional; ``specd serve --metrics-port``).

The scrape runs on prometheus_client's HTTP thread; the router lives on the coordinator's
event loop, so the collector asks that loop for a `Router.status` snapshot (after a
`Router.refresh`) rather than reading the router's state from another thread.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

#: (metric suffix, status key, help, kind) per replica; kind "counter" or "gauge".
REPLICA_METRICS = (
    ("active_requests", "active_requests", "Requests decoding now.", "gauge"),
    ("waiting_requests", "waiting_requests", "Requests waiting for a slot.", "gauge"),
    ("used_slots", "used_slots", "KV-cache slots in use.", "gauge"),
    ("requests_placed", "requests_placed", "Requests placed on the replica.", "counter"),
    ("steps", "steps", "Verification steps.", "counter"),
    ("tokens", "tokens_emitted", "Tokens emitted.", "counter"),
    ("tokens_per_second", "tokens_per_second", "Tokens per second over the last 10 s.", "gauge"),
    ("step_seconds", "step_seconds",
     "Mean wall time of a verify call seen by the coordinator.", "gauge"),
    ("forward_seconds_per_call", "forward_seconds_per_call",
     "Mean forward time per forward call (prefills included) reported by the replica.", "gauge"),
    ("bytes_sent_per_step", "bytes_sent_per_step", "Mean verify input payload bytes.", "gauge"),
    ("bytes_received_per_step", "bytes_received_per_step",
     "Mean verify output payload bytes.", "gauge"),
    ("drafter_failures", "drafter_failures", "Steps decoded undrafted: drafter failed.",
     "counter"),
    ("restarts", "restarts", "Times the replica was re-created after failing.", "counter"),
    ("draft_wait_seconds", "draft_wait_seconds",
     "Summed time steps waited for drafts before their verify could start.", "counter"),
    ("runahead_hits", "runahead_hits", "Request-steps verified with their run-ahead block.",
     "counter"),
    ("runahead_misses", "runahead_misses",
     "Request-steps whose run-ahead block was stale, mis-guessed, late or failed.", "counter"),
    ("target_busy_fraction", "target_busy_fraction",
     "Replica compute seconds over the seconds it had requests (1: never idle).", "gauge"),
    # The step schedule (`coordinator.step.schedule`): chosen by measurement with --pipeline auto.
    ("pipelined", "pipeline",
     "1 while the replica's steps run pipelined (drafting the next block during the verify), "
     "0 while serial.", "gauge"),
    ("pipelined_steps", "pipelined_steps", "Verification steps run pipelined.", "counter"),
    ("serial_steps", "serial_steps", "Verification steps run serial.", "counter"),
    ("undrafted_steps", "undrafted_steps",
     "Verification steps run with no drafter call (auto chose plain decoding).", "counter"),
    ("schedule_switches", "schedule_switches",
     "Times the replica's loop changed step schedule (--pipeline auto).", "counter"),
    ("grammar_forced_drafts", "forced_tokens",
     "Draft tokens a constraint forced (drafted by the grammar, always accepted).", "counter"),
    ("grammar_rejected_drafts", "grammar_rejected_tokens",
     "Drafter tokens a constraint refused (rejected by the rule).", "counter"),
    # Prefix reuse, from the replica's last status (`TargetEngine.stats`).
    ("prefix_queries", "prefix_queries", "Requests that looked for a warm prefix.", "counter"),
    ("prefix_hits", "prefix_hits", "Requests that reused a warm prefix.", "counter"),
    ("prefix_hit_tokens", "prefix_hit_tokens",
     "Prompt tokens not computed thanks to a warm prefix.", "counter"),
    ("prefix_copies", "prefix_copies",
     "Reuses that copied a shared span out of a warm entry that stays warm.", "counter"),
    ("warm_entries", "warm_entries", "Warm prefix entries kept for reuse.", "gauge"),
    ("warm_positions", "warm_positions", "Positions the warm prefix entries hold.", "gauge"),
    ("warm_bytes", "warm_bytes",
     "Bytes of keys and values at the warm positions (every rank's).", "gauge"),
)

#: (metric suffix, `coordinator.step.latency.LatencyHistograms` name, help) per replica: vLLM's
#: names with the ``specd_`` prefix.
LATENCY_METRICS = (
    ("time_to_first_token_seconds", "ttft", "Time from submission to the first token streamed."),
    ("inter_token_latency_seconds", "itl",
     "Time between two streamed chunks of one request (a speculative step streams several "
     "tokens at once)."),
    ("request_prefill_time_seconds", "prefill",
     "Time from a request's first prompt chunk sent to its first token sampled."),
)

#: The same for each drafter worker.
DRAFTER_METRICS = (
    ("calls", "calls", "Propose calls.", "counter"),
    ("errors", "errors", "Failed or timed-out Propose calls.", "counter"),
    ("latency_seconds", "latency_s", "Summed Propose wall time.", "counter"),
    ("assigned_requests", "assigned_requests", "Requests drafted by this worker.", "gauge"),
    ("in_flight", "in_flight", "Propose calls outstanding.", "gauge"),
    ("restarts", "restarts", "Times the worker was replaced after failing.", "counter"),
    # The worker's cross-request cache (suffix decoding; 0 without one), as last reported.
    ("cache_outputs", "cache_outputs", "Previous requests' outputs in the worker's cache.",
     "gauge"),
    ("cache_tokens", "cache_tokens", "Tokens of the outputs in the worker's cache.", "gauge"),
    ("cache_nodes", "cache_nodes", "Suffix-tree nodes of the worker's cache.", "gauge"),
    ("cache_bytes", "cache_bytes", "Approximate memory of the worker's cache, bytes.", "gauge"),
    ("cache_evicted", "cache_evicted", "Outputs evicted from the worker's cache (FIFO).",
     "counter"),
    ("cache_partitions", "cache_partitions",
     "Partitions (tenant, cache_salt) holding outputs in the worker's cache.", "gauge"),
    ("proposals", "proposals", "Proposals the drafter made (one per request step drafted).",
     "counter"),
    ("global_hits", "global_hits",
     "Proposals drafted from previous requests' outputs (the cache's draft won).", "counter"),
)


#: (metric suffix, `coordinator.front.gateway.Gateway.tenant_stats` key, help) per tenant.
TENANT_METRICS = (
    ("requests", "requests", "Requests (choices) queued for the tenant."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of the tenant's queued requests."),
    ("generation_tokens", "generation_tokens", "Tokens generated for the tenant's finished "
                                               "requests."),
)


class RouterCollector:
    """A prometheus_client collector over a `coordinator.cluster.router.Router` on ``loop``, and the
    per-tenant counters of ``tenant_stats`` (`coordinator.front.gateway.Gateway.tenant_stats`,
    read on ``loop`` too; None: none exported), labelled ``tenant``."""

    def __init__(self, router, loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0,
                 tenant_stats: dict | None = None):
        self.router = router
        self.loop = loop
        self.timeout_s = timeout_s
        self.tenant_stats = tenant_stats

    async def _snapshot(self) -> dict:
        await self.router.refresh()
        status = self.router.status()
        status["tenants"] = {name: dict(row) for name, row in (self.tenant_stats or {}).items()}
        return status

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        try:
            status = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop).result(
                self.timeout_s)
        except Exception as exc:  # a scrape must not crash the exporter
            log.warning("metrics snapshot failed: %r", exc)
            return
        for prefix, label, rows, table in (
                ("specd_replica_", "replica", status["replicas"], REPLICA_METRICS),
                ("specd_drafter_", "drafter", status["drafters"], DRAFTER_METRICS)):
            for suffix, key, doc, kind in table:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    prefix + suffix, doc, labels=[label])
                for row in rows:
                    family.add_metric([row["name"]], float(row[key]))
                yield family
        family = GaugeMetricFamily(
            "specd_replica_schedule_seconds_per_token",
            "Wall time per committed token an auto-scheduled replica measured for a step "
            "schedule, by bucket of active requests (its least count).",
            labels=["replica", "schedule", "active_requests"])
        for row in status["replicas"]:
            for cost in row.get("schedule_costs", ()):
                for schedule in ("pipelined", "serial", "undrafted"):
                    value = cost[f"{schedule}_seconds_per_token"]
                    if value:  # 0: not measured yet
                        family.add_metric([row["name"], schedule,
                                           str(cost["active_requests"])], value)
        yield family
        for suffix, key, doc in LATENCY_METRICS:
            family = HistogramMetricFamily("specd_" + suffix, doc, labels=["replica"])
            for row in status["replicas"]:
                h = row["latency"][key]
                cumulative, buckets = 0, []
                for bound, n in zip([*map(str, h["bounds"]), "+Inf"], h["counts"], strict=True):
                    cumulative += n
                    buckets.append((bound, cumulative))
                family.add_metric([row["name"]], buckets, h["sum"])
            yield family
        for suffix, key, doc in TENANT_METRICS:
            family = CounterMetricFamily("specd_tenant_" + suffix, doc, labels=["tenant"])
            for name, row in sorted(status.get("tenants", {}).items()):
                family.add_metric([name], float(row[key]))
            yield family


def router_registry(router, loop: asyncio.AbstractEventLoop, tenant_stats: dict | None = None):
    """A private prometheus_client registry holding a `RouterCollector`: the one registry
    both ``--metrics-port`` and the HTTP API's ``/metrics`` serve.

    Raises:
        ImportError: prometheus_client is not installed (``pip install 'specd[metrics]'``).
    """
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router, loop, tenant_stats=tenant_stats))
    return registry


def start_exporter(router, loop: asyncio.AbstractEventLoop, host: str = "127.0.0.1",
                   port: int = 0, registry=None):
    """Serves ``/metrics`` on ``host:port`` (0 picks a free port) from ``registry`` (default
    a new `router_registry`).

    Returns:
        ``(server, bound_port)``; stop with ``server.shutdown()``.

    Raises:
        ImportError: prometheus_client is not installed (``pip install 'specd[metrics]'``).
        OSError: the port cannot be bound.
    """
    from prometheus_client import start_http_server

    if registry is None:
        registry = router_registry(router, loop)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
