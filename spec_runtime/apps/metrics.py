"""The server's Prometheus metrics: requests by endpoint and status, errors by type, tokens read
and generated, draft tokens proposed and accepted (in all and by draft position), time to first
token and request duration, the slots' state and, with lanes, the batch: requests decoding
together and calls by the requests they carried (GET /metrics).

Each metric is named `draftproof_*`.
"""

import time

from ..decode.stats import Counts
from .slots import Slots



class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several apps in one process,
    as in the tests and in Ray Serve's replicas, do not collide)."""

    def __init__(self, slots: Slots):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("draftproof_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("draftproof_errors", "requests answered with an error, by type",
                              ["type"], registry=r)
        self.prompt_tokens = Counter("draftproof_prompt_tokens", "prompt tokens read", registry=r)
        self.generated = Counter("draftproof_generated_tokens", "tokens generated", registry=r)
        self.proposed = Counter("draftproof_draft_tokens_proposed", "draft tokens proposed",
                                registry=r)
        self.accepted = Counter("draftproof_draft_tokens_accepted", "draft tokens accepted",
                                registry=r)
        self.acceptance = Gauge("draftproof_acceptance_rate",
                                "accepted / proposed draft tokens since the server started",
                                registry=r)
        self.acceptance.set_function(
            lambda: self.accepted._value.get() / max(self.proposed._value.get(), 1))
        self.tokens_per_s = Histogram(
            "draftproof_request_tokens_per_second", "a request's new tokens / its decode time",
            buckets=(5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500, 1000), registry=r)
        self.ttft = Histogram("draftproof_time_to_first_token_seconds",
                              "from the request's arrival to its first token", registry=r)
        self.latency = Histogram("draftproof_request_duration_seconds",
                                 "from the request's arrival to its last token", registry=r)
        queue = Gauge("draftproof_queue_depth", "requests waiting for a slot", registry=r)
        queue.set_function(lambda: slots.waiting)
        busy = Gauge("draftproof_slots_busy", "slots decoding a request", registry=r)
        busy.set_function(lambda: slots.busy)
        total = Gauge("draftproof_slots", "slots (requests decoded at once)", registry=r)
        total.set(len(slots.generators))
        self.position_reached = Counter(
            "draftproof_draft_position_reached", "rounds whose drafts reached this position "
            "(1 = the first draft token)", ["position"], registry=r)
        self.position_accepted = Counter(
            "draftproof_draft_position_accepted", "rounds that accepted the draft token at this "
            "position", ["position"], registry=r)
        if slots.gate is not None:
            r.register(_BatchCollector(slots.gate))

    def finished(self, stats: Counts, started: float, first: float | None) -> None:
        """A request answered: `stats`, a generation's or a transcription's."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated.inc(stats.new_tokens)
        self.proposed.inc(stats.proposed)
        self.accepted.inc(stats.accepted)
        for j, (reached, accepted) in enumerate(stats.accepted_by_position):
            self.position_reached.labels(str(j + 1)).inc(reached)
            self.position_accepted.labels(str(j + 1)).inc(accepted)
        if stats.tokens_per_s:
            self.tokens_per_s.observe(stats.tokens_per_s)
        now = time.monotonic()
        if first is not None:
            self.ttft.observe(first - started)
        self.latency.observe(now - started)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _BatchCollector:
    """The slots' shared calls (engines/gate.py), read when scraped: the sequences decoding
    together now, and the calls made so far by how many sequences each carried."""

    def __init__(self, gate):
        self.gate = gate

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        size = GaugeMetricFamily("draftproof_batch_size", "requests decoding together now")
        size.add_metric([], self.gate.members)
        yield size
        calls = CounterMetricFamily("draftproof_batch_calls", "model calls by the requests they "
                                    "carried (1: alone)", labels=["size"])
        counts = self.gate.counts
        alone = counts.alone + counts.by_size.get(1, 0)
        for n, k in sorted({**counts.by_size, 1: alone}.items()):
            calls.add_metric([str(n)], k)
        yield calls
