"""The gateway's ASGI application (Starlette): OpenAI's endpoints, health, metrics, status page.

Every generation is one ``generate`` request on the pipeline, read token by token (time to first
token and per-token latency are measured here, and logprobs arrive per token). A task watches
the HTTP connection meanwhile: when the client goes away, the gateway sends ``cancel`` for the
request at once, so the pipeline does not generate for nobody.

Every request is bounded before it costs anything (``limits``): a generation takes one of the
gateway's request slots (a per-client share of them, refused 429, and the total, refused 503),
then its body is read at most ``max_body_bytes`` (413) within ``body_timeout_s`` (408). Each
error kind has its HTTP status (``openai_schema.WIRE_ERRORS``), and a generation gives back
everything it holds (slot, stream, gauge) on every path, exactly once (``Generation.close``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ntx.ctl.gateway import openai_schema as oa
from ntx.ctl.gateway.address import is_loopback
from ntx.ctl.gateway.limits import GatewayLimits, Shares
from ntx.ctl.gateway.link import FrameRefused, FrameTooLarge, PipelineGone, PipelineLink, RequestStream
from ntx.ctl.gateway.metrics import GatewayMetrics


def client_of(request: HttpRequest) -> str:
    """Who a request counts against: its client's address as uvicorn gives it (the TCP peer's,
    or for a reverse proxy on loopback the one X-Forwarded-For names; see ``limits``)."""
    return request.client.host if request.client else "local"


class Gateway:
    """What the routes share: the pipeline link, the metrics, the API key, the bounds and what
    is held of them (request slots per client, body bytes being read)."""

    def __init__(self, listen: str, api_key: str | None, limits: GatewayLimits) -> None:
        self.listen = listen
        self.api_key = api_key
        self.limits = limits
        self.link: PipelineLink | None = None
        self.metrics = GatewayMetrics(lambda: self.link.fresh_status if self.link else None)
        self.slots = Shares(limits.max_requests, limits.max_requests_per_client)
        self.body_bytes_in_flight = 0
        self.started_s = time.monotonic()  # the status page's uptime of this process

    def take_slot(self, client: str) -> None:
        """One generation slot for ``client``, or ApiError: 429 when the client holds its share,
        503 when the gateway is full (both with Retry-After)."""
        refusal = self.slots.refusal(client)
        if refusal == "client":
            raise oa.ApiError(429, f"this client has {self.slots.per_client} requests in flight, the most one client "
                                   "may; retry when one ends", "rate_limit_error", code="rate_limit_exceeded",
                              headers=oa.retry_after())
        if refusal == "total":
            raise oa.ApiError(503, f"the gateway has {self.slots.total} requests in flight, the most it takes; "
                                   "retry later", "service_unavailable", code="overloaded", headers=oa.retry_after())
        self.slots.take(client)

    def check_key(self, request: HttpRequest) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise oa.ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                              code="invalid_api_key")

    def serving_status(self) -> dict:
        """The pipeline's status, or a 503 if it does not answer or cannot take requests."""
        st = self.link.fresh_status
        if st is None:
            raise oa.ApiError(503, f"the pipeline on {self.listen} does not answer", "service_unavailable",
                              code="pipeline_lost", headers=oa.retry_after())
        if st.get("state") not in ("ready", "starting"):
            raise oa.ApiError(503, f"the pipeline is {st.get('state')}", "service_unavailable",
                              headers=oa.retry_after())
        return st

    @staticmethod
    def model_name(st: dict) -> str:
        return os.path.basename(st.get("model", "")) or "ntx"


class Generation:
    """One HTTP request's run on the pipeline: its events, its metrics, its cancellation."""

    def __init__(self, gw: Gateway, request: HttpRequest, parsed: oa.Parsed, endpoint: str, client: str) -> None:
        """``client`` holds a slot (``Gateway.take_slot``) that this generation now owns."""
        self.gw = gw
        self.request = request
        self.parsed = parsed
        self.endpoint = endpoint
        self.client = client
        self.started_s = time.monotonic()
        self.last_token_s: float | None = None
        self.stream: RequestStream | None = None
        self.finish = "error"
        self.closed = False
        self._watch: asyncio.Task | None = None  # awaits the client's hang-up
        self._events: AsyncIterator[dict] | None = None

    async def start(self) -> dict:
        """Submit the request and wait for its first event; an error reply raises ApiError
        (so it is answered with its HTTP status, before any stream begins)."""
        try:
            self.stream = self.gw.link.submit(self.parsed.wire)
        except FrameTooLarge as e:
            await self.close()
            raise oa.ApiError(413, str(e), code="request_too_large") from None
        except FrameRefused as e:
            await self.close()
            raise oa.ApiError(400, str(e)) from None
        except PipelineGone as e:
            await self.close()
            raise oa.ApiError(503, str(e), "service_unavailable", code="pipeline_lost",
                              headers=oa.retry_after()) from None
        self.gw.metrics.in_flight.inc()
        self._watch = asyncio.create_task(self._watch_disconnect())
        self._events = self._read()
        try:
            first = await anext(self._events)
        except BaseException:
            await self.close()
            raise
        return first

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.finish = "cancelled"
                self.stream.cancel()
                return

    async def _read(self) -> AsyncIterator[dict]:
        async for ev in self.stream:
            if ev["type"] == "error":
                raise oa.wire_error(ev)
            if ev["type"] == "token":
                now = time.monotonic()
                if self.last_token_s is None:
                    self.gw.metrics.ttft_s.observe(now - self.started_s)
                else:
                    self.gw.metrics.token_s.observe(now - self.last_token_s)
                self.last_token_s = now
            elif ev["type"] == "done":
                self.finish = ev.get("finish_reason", "stop")
                u = ev.get("usage", {})
                self.gw.metrics.prompt_tokens.inc(u.get("prompt_tokens", 0))
                self.gw.metrics.generated_tokens.inc(u.get("completion_tokens", 0))
            yield ev

    async def rest(self) -> AsyncIterator[dict]:
        """The events after the first, to ``done``."""
        async for ev in self._events:
            yield ev

    async def close(self) -> None:
        """Cancel the request if it still runs (the client left, or the response failed), give
        back its slot and stream, and count it. Safe to call more than once, and before the
        request was sent."""
        if self.closed:
            return
        self.closed = True
        self.gw.slots.give_back(self.client)
        if self._watch is not None:
            self._watch.cancel()
        if self.stream is None:  # never sent
            return
        if not self.stream.finished:
            self.finish = "cancelled"
            self.stream.cancel()
        self.gw.link.forget(self.stream)
        self.gw.metrics.in_flight.dec()
        self.gw.metrics.requests.labels(self.endpoint, self.finish).inc()


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


async def read_body(request: HttpRequest, gw: Gateway) -> bytes:
    """The request's body, read at most ``max_body_bytes`` (413, refused by its Content-Length
    before a byte is read when it says so) within ``body_timeout_s`` (408). Bodies being read
    hold at most ``max_body_bytes_in_flight`` together (503): many slow large uploads cannot
    fill the gateway's memory."""
    limits = gw.limits
    too_large = oa.ApiError(413, f"the request body is larger than the gateway's limit of {limits.max_body_bytes} "
                                 "bytes", code="request_too_large", headers={"Connection": "close"})
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limits.max_body_bytes:
        raise too_large
    chunks: list[bytes] = []
    n_bytes = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                if n_bytes + len(chunk) > limits.max_body_bytes:
                    raise too_large
                if gw.body_bytes_in_flight + len(chunk) > limits.max_body_bytes_in_flight:
                    raise oa.ApiError(503, "the gateway is reading too many request bodies at once; retry later",
                                      "service_unavailable", code="overloaded",
                                      headers={**oa.retry_after(), "Connection": "close"})
                gw.body_bytes_in_flight += len(chunk)
                n_bytes += len(chunk)
                chunks.append(chunk)
    except TimeoutError:
        raise oa.ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                          code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise oa.ApiError(400, "the client closed the connection before its body was read") from None
    finally:
        gw.body_bytes_in_flight -= n_bytes
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise oa.ApiError(400, "the request body's JSON nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise oa.ApiError(400, f"the request body is not valid JSON ({str(e):.100})") from None
    if not isinstance(body, dict):
        raise oa.ApiError(400, "the request body must be a JSON object")
    return body


class GenerationStream(StreamingResponse):
    """A generation's server-sent events; the generation is closed when the response ends in
    any way, including a client gone before the first chunk (the body's generator is then
    never started, so its own ``finally`` would not run)."""

    def __init__(self, gen: Generation, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.gen.close()


def _streaming(gen: Generation, chunks: AsyncIterator[bytes]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except oa.ApiError as e:  # after the stream began: an error event, as OpenAI does
            yield _sse(e.body())
        finally:
            await gen.close()
        yield SSE_DONE

    return GenerationStream(gen, body())


@dataclass
class Started:
    """A generation under way for one endpoint: its events (the first already in), and what
    every response of it names."""

    parsed: oa.Parsed
    gen: Generation
    events: AsyncIterator[dict]
    model: str
    rid: str
    created: int
    logprobs: oa.LogprobsBuilder | None


async def _start(request: HttpRequest, parse, endpoint: str, id_prefix: str) -> Started:
    """Check the key, take a slot, read and check the body, start the generation and wait for
    its first event (so that a refused request is answered with its HTTP status before any
    stream begins)."""
    gw: Gateway = request.app.state.gateway
    gw.check_key(request)
    client = client_of(request)
    gw.take_slot(client)
    try:
        parsed = parse(parse_json_object(await read_body(request, gw)))
        st = gw.serving_status()
    except BaseException:
        gw.slots.give_back(client)
        raise
    lp = oa.LogprobsBuilder(parsed.top_logprobs) if parsed.top_logprobs is not None else None
    gen = Generation(gw, request, parsed, endpoint, client)
    first = await gen.start()

    async def events() -> AsyncIterator[dict]:
        yield first
        async for ev in gen.rest():
            yield ev

    return Started(parsed, gen, events(), gw.model_name(st), f"{id_prefix}-{secrets.token_hex(12)}",
                   int(time.time()), lp)


async def _collect(s: Started) -> tuple[list[dict], dict]:
    """A non-streamed generation's token events and its ``done`` event."""
    tokens, done = [], {}
    try:
        async for ev in s.events:
            if ev["type"] == "token":
                tokens.append(ev)
            elif ev["type"] == "done":
                done = ev
    finally:
        await s.gen.close()
    return tokens, done


async def chat_completions(request: HttpRequest) -> Response:
    s = await _start(request, oa.parse_chat, "chat", "chatcmpl")
    lp = s.logprobs
    if not s.parsed.stream:
        tokens, done = await _collect(s)
        return JSONResponse(oa.chat_response(s.rid, s.model, done, [lp.chat_entry(t) for t in tokens] if lp else None))

    def chunk(delta: dict, **kw) -> dict:
        return oa.chat_chunk(s.rid, s.model, s.created, delta, **kw)

    async def chunks() -> AsyncIterator[bytes]:
        yield _sse(chunk({"role": "assistant", "content": ""}))
        async for ev in s.events:
            if ev["type"] == "token":
                if ev["text"] or lp:
                    yield _sse(chunk({"content": ev["text"]}, logprobs=[lp.chat_entry(ev)] if lp else None))
            elif ev["type"] == "done":
                if ev.get("tail"):
                    yield _sse(chunk({"content": ev["tail"]}))
                usage = None if s.parsed.include_usage else oa.usage(ev)
                yield _sse(chunk({}, finish=oa.finish_reason(ev), usage_=usage) | oa.ntx_extra(ev))
                if s.parsed.include_usage:
                    yield _sse(_usage_chunk(s, "chat.completion.chunk", ev))

    return _streaming(s.gen, chunks())


async def completions(request: HttpRequest) -> Response:
    s = await _start(request, oa.parse_completion, "completions", "cmpl")
    lp = s.logprobs
    if not s.parsed.stream:
        tokens, done = await _collect(s)
        return JSONResponse(oa.completion_response(s.rid, s.model, done, lp.completion_part(tokens, 0) if lp else None))

    async def chunks() -> AsyncIterator[bytes]:
        offset = 0
        async for ev in s.events:
            if ev["type"] == "token":
                if ev["text"] or lp:
                    part = lp.completion_part([ev], offset) if lp else None
                    yield _sse(oa.completion_chunk(s.rid, s.model, s.created, ev["text"], logprobs=part))
                    offset += len(ev["text"])
            elif ev["type"] == "done":
                usage = None if s.parsed.include_usage else oa.usage(ev)
                yield _sse(oa.completion_chunk(s.rid, s.model, s.created, ev.get("tail", ""), oa.finish_reason(ev),
                                               usage_=usage) | oa.ntx_extra(ev))
                if s.parsed.include_usage:
                    yield _sse(_usage_chunk(s, "text_completion", ev))

    return _streaming(s.gen, chunks())


def _usage_chunk(s: Started, object_: str, done: dict) -> dict:
    """With ``stream_options.include_usage``: OpenAI's last chunk, no choices and the usage."""
    return {"id": s.rid, "object": object_, "created": s.created, "model": s.model, "choices": [],
            "usage": oa.usage(done)}


async def models(request: HttpRequest) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.check_key(request)
    st = gw.serving_status()
    return JSONResponse({"object": "list", "data": [
        {"id": gw.model_name(st), "object": "model", "created": int(time.time() - st.get("uptime_s", 0)),
         "owned_by": "ntx"}]})


def health_of(st: dict | None) -> tuple[int, dict]:
    """/health's answer (HTTP status, body) for a pipeline status (None: it does not answer):
    the gateway's, and a cluster replica's own health check (ctl/cluster)."""
    if st is None:
        return 503, {"status": "unavailable", "message": "the pipeline does not answer"}
    if st.get("state") != "ready":
        return 503, {"status": "loading" if st.get("state") == "starting" else st.get("state")}
    return 200, {"status": "ok"}


async def health(request: HttpRequest) -> Response:
    """200 when the pipeline is ready, 503 while it loads, restarts, stops or does not answer
    (no key needed: load balancers and orchestrators probe it)."""
    code, body = health_of(request.app.state.gateway.link.fresh_status)
    return JSONResponse(body, code)


async def metrics(request: HttpRequest) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.check_key(request)
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def status_page(request: HttpRequest) -> Response:
    """The live status page: static HTML whose script polls /api/status (the key, if one is
    needed, comes from the page address' #key=… fragment, which browsers never send)."""
    return HTMLResponse(resources.files("ntx.ctl.gateway").joinpath("status_page.html").read_text())


# What only operators see of the status (the supervisor's OPERATOR_STATUS_FIELDS, which
# tests/test_gateway_limits.py holds to be among these, and where it writes and serves), and
# each daemon's pid. The gateway's own connection is from this machine, so it gets them all.
OPERATOR_FIELDS = ("model", "listen", "supervisor_pid", "reason", "log_dir", "http")


def status_for(st: dict | None, operator: bool) -> dict | None:
    """The status for an operator (all of it), or for anyone else: less ``OPERATOR_FIELDS`` and
    the daemons' pids."""
    if st is None or operator:
        return st
    out = {k: v for k, v in st.items() if k not in OPERATOR_FIELDS}
    if isinstance(out.get("daemons"), dict):
        out["daemons"] = {n: {k: v for k, v in d.items() if k != "pid"} if isinstance(d, dict) else d
                          for n, d in out["daemons"].items()}
    return out


async def api_status(request: HttpRequest) -> Response:
    """The status page's data: the status, its last minute, and this gateway process (its
    requests in flight, uptime and pid). Operators (requests from this machine's loopback) see
    all of it; anyone else, with the key where one is needed, sees it without paths, pids and
    addresses."""
    gw: Gateway = request.app.state.gateway
    gw.check_key(request)
    operator = request.client is not None and is_loopback(request.client.host)
    own = {"in_flight": gw.link.in_flight, "uptime_s": round(time.monotonic() - gw.started_s, 3),
           **({"pid": os.getpid()} if operator else {})}
    return JSONResponse({"status": status_for(gw.link.fresh_status, operator), "history": list(gw.link.history),
                         "gateway": own})


async def _api_error(request: HttpRequest, exc: oa.ApiError) -> Response:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def _http_error(request: HttpRequest, exc: HTTPException) -> Response:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(oa.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_).body(),
                        exc.status_code)


def create_app(listen: str, api_key: str | None = None, limits: GatewayLimits | None = None,
               make_link: Callable[[Gateway], Any] | None = None, extra_routes: tuple[Route, ...] = ()) -> Starlette:
    """The gateway for the pipeline whose client address is ``listen``.

    ``make_link(gateway)`` gives another link than one pipeline's ``PipelineLink`` (a cluster's
    replicas, ctl/cluster/link.py: the same ``submit``/``forget``/``fresh_status`` and stream
    interface), made at startup; ``extra_routes`` are added to the gateway's own. Every route,
    check and error is then the same for either."""
    gw = Gateway(listen, api_key, limits or GatewayLimits())

    @asynccontextmanager
    async def lifespan(app: Starlette):
        gw.link = make_link(gw) if make_link else PipelineLink(listen, gw.limits.reply_timeout_s)
        gw.link.start()
        try:
            yield
        finally:
            await gw.link.close()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/api/status", api_status, methods=["GET"]),
            Route("/", status_page, methods=["GET"]),
            *extra_routes,
        ],
        exception_handlers={oa.ApiError: _api_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app
