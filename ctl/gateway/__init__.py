"""The HTTP gateway: OpenAI's API, Prometheus metrics, a health probe and a live status page in
front of a running pipeline.

It is its own process (``python -m ntx.ctl.gateway``, started by the supervisor for ``ntxctl
start --http ADDR``) and a plain client of the ZeroMQ protocol (docs/PROTOCOL.md): the
supervisor's loop stays a non-blocking ZeroMQ poll with no HTTP parsing in it, a crash or a slow
HTTP client cannot stall the pipeline, and everything the gateway does, any other client could.

Modules: ``link`` (the ZeroMQ connection and status polling), ``openai_schema`` (request and
response mapping), ``metrics`` (/metrics), ``app`` (the Starlette routes), ``status_page.html``.
"""
