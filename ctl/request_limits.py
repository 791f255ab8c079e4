"""How much one request, one connection and the whole queue may ask of an instance.

The frame itself is bounded where it is decoded (``messages.unpack_client_frame``: size,
nesting, map and array lengths, known fields only); what is left depends on the instance and is
held here, for the front's one check of a request (``ctl/requests.py``): a prompt that cannot
fit in the context is refused by its size *before* it is tokenized (a 10 MiB prompt once held
the pipeline, and every client behind it, for 7.8 s), ``max_tokens`` is at most the context;
and the supervisor's queue is bounded so a burst is answered with ``overloaded`` instead of
being lost. docs/PROTOCOL.md ("Limits") lists every bound; docs/RELIABILITY.md the attacks
behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntx.shared.messages import MAX_FRAME_BYTES

# No tokenizer of a supported model has tokens this long on average, so a prompt of more bytes
# than this many per context token cannot fit, whatever it says.
MAX_PROMPT_BYTES_PER_TOKEN = 32
# Requests the supervisor holds back while compute has its window full, and their frames' bytes.
MAX_QUEUED_REQUESTS = 1024
MAX_QUEUED_BYTES = 64 << 20
# Requests one connection may have in flight (queued or at compute); an HTTP gateway is one
# connection for all of its users.
MAX_REQUESTS_PER_CONNECTION = 256
# Requests forwarded to compute and not finished, at most: twice a full batch keeps compute's
# next admissions at hand while the rest wait in the supervisor, and keeps the control socket
# to compute far below its high-water mark (so a send there never waits, let alone drops).
MAX_COMPUTE_WINDOW = 256


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one instance: its context (tokens per sequence) and batch."""

    max_context: int
    max_batch: int

    @property
    def max_prompt_bytes(self) -> int:
        return min(MAX_FRAME_BYTES, self.max_context * MAX_PROMPT_BYTES_PER_TOKEN)

    @property
    def compute_window(self) -> int:
        return min(2 * self.max_batch, MAX_COMPUTE_WINDOW)
