"""How much one request, one connection and the whole queue may ask of an instance.

The frame itself is bounded where it is decoded (``messages.unpack_client_frame``: size,
nesting, map and array lengths, known fields only); what is left depends on the instance and is
checked here, in the supervisor, before anything reaches compute: a prompt that cannot fit in the
context is refused by its size *before* compute tokenizes it (a 10 MiB prompt once held compute,
and every client behind it, for 7.8 s), ``max_tokens`` is at most the context, and the queue is
bounded so a burst is answered with ``overloaded`` instead of being lost. docs/PROTOCOL.md
("Limits") lists every bound; docs/RELIABILITY.md the attacks behind them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ntx.shared.messages import MAX_FRAME_BYTES, ProtocolError

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
    """The bounds of one instance (its context and batch) for a checked generate map."""

    max_context: int
    max_batch: int

    @property
    def max_prompt_bytes(self) -> int:
        return min(MAX_FRAME_BYTES, self.max_context * MAX_PROMPT_BYTES_PER_TOKEN)

    @property
    def compute_window(self) -> int:
        return min(2 * self.max_batch, MAX_COMPUTE_WINDOW)

    def check(self, msg: dict[str, Any]) -> None:
        """Raise ProtocolError if a generate map (already checked by ``check_generate``) asks for
        more than this instance can give."""
        if msg.get("max_tokens", 0) > self.max_context:
            raise ProtocolError("bad_request", f"max_tokens {msg['max_tokens']} exceeds the context of "
                                               f"{self.max_context} tokens")
        if "tokens" in msg and len(msg["tokens"]) > self.max_context:
            raise ProtocolError("context_overflow", f"{len(msg['tokens'])} prompt tokens do not fit in the context "
                                                    f"of {self.max_context} tokens")
        if "prompt" in msg:
            n_bytes = len(msg["prompt"].encode("utf-8", "surrogatepass"))
        elif "messages" in msg:
            if len(msg["messages"]) > self.max_context:
                raise ProtocolError("context_overflow", f"{len(msg['messages'])} messages do not fit in the context "
                                                        f"of {self.max_context} tokens")
            n_bytes = sum(len(e["role"].encode("utf-8", "surrogatepass")) + len(e["content"].encode("utf-8", "surrogatepass"))
                          for e in msg["messages"])
        else:
            return
        if n_bytes > self.max_prompt_bytes:
            raise ProtocolError("context_overflow", f"a prompt of {n_bytes} bytes cannot fit in the context of "
                                                    f"{self.max_context} tokens (at most {self.max_prompt_bytes} "
                                                    "bytes are tokenized)")
