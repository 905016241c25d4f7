"""Prometheus metrics of one server, in a registry of its own (so several servers can run in one
process, as the tests do), exposed over HTTP by prometheus-client's server on `--metrics-port`.

Latencies are measured against the arrival of the input they answer: an update's latency runs from
the arrival of the frame at its end (`end_s`) to the event leaving the engine; time to first
partial from the arrival of a segment's first frames to its first event; final latency from the
arrival of the segment's end to its final event.

Gauges of what is there now (`harken_streams_attached`, `harken_queue_depth`) are computed from the
state itself when scraped (`read_at_scrape`), not counted up and down, so they cannot drift from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class ServerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self):
        r = self.registry
        self.sessions = Gauge("harken_sessions_active", "Sessions held (attached or in their grace period)",
                              registry=r)
        self.streams = Gauge("harken_streams_attached", "Client streams attached to a session (at scrape time)",
                             registry=r)
        self.update_latency = Histogram("harken_update_latency_seconds",
                                        "Arrival of the frame at an update's end -> its transcript event",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.first_partial = Histogram("harken_time_to_first_partial_seconds",
                                       "Arrival of a segment's first frames -> its first transcript event",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.final_latency = Histogram("harken_final_latency_seconds",
                                       "Arrival of a segment's end -> its final transcript event",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("harken_queue_depth",
                                 "Sessions with work waiting for the model (a pass due, none in flight; at scrape "
                                 "time)", registry=r)
        self.batch_size = Histogram("harken_batch_size", "Sessions in one batched model step",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.bytes_in = Counter("harken_bytes_in", "Payload bytes received", ["kind"], registry=r)
        self.messages_in = Counter("harken_messages_in", "Client messages applied", ["kind"], registry=r)
        self.audio_paced = Counter("harken_audio_paced_seconds",
                                   "Wall seconds streams were held back for sending audio faster than their pace "
                                   "(--max-audio-speed, --audio-burst-s)", registry=r)
        self.events_out = Counter("harken_transcript_events", "Transcript events produced", registry=r)
        self.decode_truncated = Counter("harken_decode_truncated_total",
                                        "Decodes ended by a limit, not by the model: the audio-proportional "
                                        "token budget or the hallucination-loop guard", ["reason"], registry=r)
        self.passes_deferred = Counter("harken_passes_deferred_total",
                                       "Ticks in which a ready stream running ahead of real time (a file, a "
                                       "replay, a flood) waited for live streams", registry=r)
        self.errors = Counter("harken_errors", "Streams ended with an error, by gRPC status code (a message "
                              "over the size limit: RESOURCE_EXHAUSTED; an idle stream: DEADLINE_EXCEEDED)",
                              ["code"], registry=r)

    def read_at_scrape(self, attached_streams: Callable[[], int], ready_sessions: Callable[[], int]) -> None:
        """Compute the attached-streams and queue-depth gauges when scraped (from the scrape's
        thread: both callables must be thread-safe)."""
        self.streams.set_function(attached_streams)
        self.queue_depth.set_function(ready_sessions)


@dataclass
class MetricsEndpoint:
    """prometheus-client's HTTP server thread; `port` is the real one (for --metrics-port 0)."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve_metrics(metrics: ServerMetrics, host: str, port: int) -> MetricsEndpoint:
    httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsEndpoint(httpd, thread)
