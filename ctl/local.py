"""The front and the engine core in this process, without any daemon or socket.

``ntxctl generate`` falls back to this when no pipeline is running, and tests use it as the
reference the pipeline must agree with: a request takes the same way as in the pipeline — the
front's one check and its prompt as token ids (``ctl/requests.py``), the engine core's passes
(``daemons/compute/engine.py``), the front's replies — and the replies are the maps a client of
the pipeline receives. The engine is assembled by the one factory
(``ntx.daemons.compute.factory``); this adds the loading progress a terminal user sees.
"""

from __future__ import annotations

import sys
from typing import Any

from ntx.ctl.request_limits import RequestLimits
from ntx.ctl.requests import OutputProcessor, RequestFront
from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.factory import build_engine
from ntx.ctl.tokenizer import Tokenizer
from ntx.shared.gguf_index import open_model
from ntx.shared.messages import EngineError, EngineEvent, EngineRequest, Reply


class LocalEngine:
    """An engine core (``core``) behind its front (``front``), stepped by the caller.

    ``generate`` takes a client's generate map as the pipeline does; ``submit`` takes a request
    already in token ids (its ``params.stop`` are matched here, as a client's stop strings).
    ``step`` runs one pass and returns the replies it made, as maps (docs/PROTOCOL.md)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.front = RequestFront.for_model(core.model.index, RequestLimits(core.max_context, core.max_batch))
        self._outputs: dict[str, OutputProcessor] = {}

    @property
    def tokenizer(self) -> Tokenizer:
        return self.front.tokenizer

    def prompt_tokens(self, prompt: str | None = None, messages: list[dict] | None = None,
                      tokens: list[int] | None = None, raw: bool = False) -> list[int]:
        """A prompt's token ids, as the front makes them (chat template unless ``raw``)."""
        return self.front.prompt_tokens(prompt, messages, tokens, raw)

    def generate(self, rid: str, msg: dict[str, Any]) -> None:
        """Queue a client's generate map (without ``op``; its ``id`` is ``rid``); RequestError,
        with the code and line a client of the pipeline would get, if it cannot be served."""
        engine_req, out = self.front.start(rid, self.front.parse({**msg, "id": rid}))
        self._submit(engine_req, out)

    def submit(self, req: EngineRequest, stream: bool = True) -> None:
        """Queue a request in token ids; RequestError if the engine cannot hold it."""
        self._submit(*self.front.prepare(req, req.id, stream))

    def _submit(self, engine_req: EngineRequest, out: OutputProcessor) -> None:
        self.core.submit(engine_req)
        self._outputs[engine_req.id] = out

    def step(self) -> list[dict[str, Any]]:
        """One pass of the engine; the replies it made."""
        return self._replies(self.core.step())

    def cancel(self, rid: str) -> list[dict[str, Any]]:
        """Cancel a request; its ``done`` reply, or [] when it is not in flight."""
        return self._replies(self.core.cancel(rid))

    def _replies(self, events: list[EngineEvent]) -> list[dict[str, Any]]:
        replies: list[Reply] = []
        for ev in events:
            out = self._outputs.get(ev.id)
            if out is None:  # ended here already (a stop string): the engine's last words are dropped
                continue
            if isinstance(ev, EngineError):
                replies.append(out.failed(ev.code, ev.message))
            else:
                replies.extend(out.process(ev))
                if out.needs_cancel:
                    self.core.cancel(ev.id)
            if out.finished:
                del self._outputs[ev.id]
        return [r.to_wire() for r in replies]

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    @property
    def active_ids(self) -> list[str]:
        return self.core.active_ids

    @property
    def queued_ids(self) -> list[str]:
        return self.core.queued_ids


def build_local_engine(model_path: str, backend: str = "cpu", resident_layers=None, progress: bool = False,
                       **engine_kw) -> LocalEngine:
    """Load ``model_path`` in-process (``build_engine``'s keywords pass through) and warm it up,
    printing "loading layers i/n" and the warm-up's stages on a terminal when ``progress``."""
    index = open_model(model_path)
    report = log = None
    if progress and sys.stderr.isatty():

        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        n = index.hparams.n_layers

        def report(i: int) -> None:
            print(f"\rloading layers {i + 1}/{n}", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)

    return LocalEngine(build_engine(index, backend, resident_layers=resident_layers, progress=report, log=log,
                                    **engine_kw))
