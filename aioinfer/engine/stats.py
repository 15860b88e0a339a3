"""The engine's counters and histograms, which /metrics and the periodic log line read.

The engine observes them per sequence (as vLLM does per child request of n > 1) when it fans
a step's outputs out, from a few timestamps each request carries: queued (`arrival_time`),
first scheduled, first and latest token. The histograms are plain bucket counts that the
server exports when scraped.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from aioinfer.core.request import Request

# vLLM's buckets (v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
STEP_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Where the host's time goes on the per-token path (aioinfer:host_seconds_total), in the order
# a token meets them: the event loop plans a step (schedule); the GPU thread builds its inputs
# (prepare), launches the forward pass and sampling (launch: on a CPU, their whole compute) and
# waits for the outputs (finish); the loop applies them (apply, of which detokenize), hands
# them to the request streams (fan_out) and the HTTP handlers write them (http_write: chunk
# building, JSON and the socket write).
HOST_PHASES = (
    "schedule", "prepare", "launch", "finish", "apply", "detokenize", "fan_out", "http_write",
)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets of token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Histogram:
    """A Prometheus histogram's state: observations per bucket (each bound inclusive) and
    their sum. One binary search per observation."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class EngineStats:
    """Counters and histograms the metrics endpoint and the periodic log line read."""

    max_model_len: int = 0  # bounds the buckets of the token-count histograms
    prompt_tokens: int = 0  # counted when prefilled
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # sequences, by finish reason
    aborted: int = 0  # requests (not sequences) that ended early, all reasons together
    aborted_by_reason: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)  # refused at admission, by reason
    # Seconds the loop's phases took (HOST_PHASES; the GPU thread's own are the runner's).
    host_seconds: dict[str, float] = field(default_factory=dict)
    # By vLLM's metric name (less its prefix).
    histograms: dict[str, Histogram] = field(init=False)

    def __post_init__(self) -> None:
        tokens = one_two_five(self.max_model_len)
        self.histograms = {
            name: Histogram(buckets)
            for name, buckets in (
                ("time_to_first_token_seconds", TTFT_BUCKETS),
                ("inter_token_latency_seconds", ITL_BUCKETS),
                ("e2e_request_latency_seconds", LATENCY_BUCKETS),
                ("request_queue_time_seconds", LATENCY_BUCKETS),
                ("request_prefill_time_seconds", LATENCY_BUCKETS),
                ("request_decode_time_seconds", LATENCY_BUCKETS),
                ("request_inference_time_seconds", LATENCY_BUCKETS),
                ("request_prompt_tokens", tokens),
                ("request_generation_tokens", tokens),
                ("request_params_n", N_BUCKETS),
                ("request_params_max_tokens", tokens),
                ("iteration_tokens_total", STEP_TOKENS_BUCKETS),
            )
        }
        self._ttft = self.histograms["time_to_first_token_seconds"]
        self._itl = self.histograms["inter_token_latency_seconds"]
        self.params_n = self.histograms["request_params_n"]  # per request, when it finishes
        self.step_tokens = self.histograms["iteration_tokens_total"]  # the tokens a step fed

    def add_host_time(self, phase: str, seconds: float) -> None:
        self.host_seconds[phase] = self.host_seconds.get(phase, 0.0) + seconds

    @staticmethod
    def count(counter: dict[str, int], key: str) -> None:
        counter[key] = counter.get(key, 0) + 1

    def sequence_output(
        self, request: Request, num_new: int, finished: bool, now: float, hidden: bool = False
    ) -> None:
        """Count one step's output of one sequence at `now` (time.monotonic()): its `num_new`
        tokens (none when a pooled prompt is done), already appended to the request. `hidden`:
        the client never sees them (echo with max_tokens 0 samples one token): not counted."""
        first = request.num_output_tokens == num_new
        if hidden:
            num_new = 0
        self.generation_tokens += num_new
        if first:
            # Its first output: the prompt is prefilled. Counted here, once, as vLLM does: a
            # request dropped while queued computed no prompt.
            self.prompt_tokens += request.num_prompt_tokens
            request.first_token_time = now
            if num_new:
                self._ttft.observe(now - request.arrival_time)
        elif num_new:
            # One gap per step, however many tokens (accepted drafts) it gave, as vLLM's.
            self._itl.observe(now - request.last_token_time)
        request.last_token_time = now
        if finished:
            self.count(self.finished, request.finish_reason or "stop")
            self._sequence_finished(request, now, hidden)

    def _sequence_finished(self, request: Request, now: float, hidden: bool) -> None:
        h = self.histograms
        queued, scheduled, first = (
            request.arrival_time,
            request.scheduled_time,
            request.first_token_time,
        )
        h["e2e_request_latency_seconds"].observe(now - queued)
        h["request_queue_time_seconds"].observe(scheduled - queued)
        h["request_prefill_time_seconds"].observe(first - scheduled)
        h["request_decode_time_seconds"].observe(now - first)
        h["request_inference_time_seconds"].observe(now - scheduled)
        h["request_prompt_tokens"].observe(request.num_prompt_tokens)
        h["request_generation_tokens"].observe(0 if hidden else request.num_output_tokens)
        max_tokens = 0 if hidden else request.sampling_params.max_tokens
        if request.pooler is None and max_tokens is not None:  # a pooled prompt samples none
            h["request_params_max_tokens"].observe(max_tokens)
