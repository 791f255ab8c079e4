"""Chat templates: a list of messages -> the prompt text the model was trained on.

The template is the Jinja2 source in the GGUF's ``tokenizer.chat_template``. It comes from a
file a user downloaded, so it runs in a sandbox: ``ImmutableSandboxedEnvironment`` (no mutation
of lists/dicts passed in, no access to ``_private``/dunder attributes; such an access raises at
once instead of rendering as empty, so ``{{ ''.__class__ }}`` is an error, never a leak).

Environment as HF ``transformers.apply_chat_template`` sets it up, so templates written for HF
render the same: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, globals
``raise_exception(msg)`` and ``strftime_now(fmt)``, a ``tojson`` filter that does not
HTML-escape (Jinja's own does) and accepts ``indent``/``separators``/``sort_keys``.

Missing template: we fall back to ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), what
llama.cpp does too; ``ChatTemplate.is_fallback`` says so, so the server can log it.

Every failure a template can cause (syntax error, ``raise_exception``, undefined use, sandbox
violation, and any exception its code raises: an overflow, a recursion without end, a memory
error) is an ``NtxError`` with one line: the front renders templates inside the supervisor, where
an exception must end the one request, never the loop.

**Bounds.** The sandbox stops attribute tricks, not work: nested loops of 10^10 iterations, a
string doubled thirty times or ``'x'.center(10**10)`` run in C, where no Python-level hook or
timer stops them, and a failed allocation inside the supervisor could end more than one request.
So renders run in a worker process (``RenderWorker``, ``python -m ntx.ctl.chat``), one at a
time: at most ``RENDER_TIME_LIMIT_S`` of wall time each (then the worker is killed),
``RENDER_MEMORY_LIMIT_BYTES`` of address space beyond what the worker holds at start
(``RLIMIT_AS``: a memory bomb is a ``MemoryError`` there, after which it exits),
``RENDER_OUTPUT_LIMIT_CHARS`` of output, Python's recursion limit. A worker that stopped is
started again at the next render. A persistent worker, not a fork per render: forking a
supervisor that holds a tokenizer cost 10-25 ms a request, a round trip to the worker well under
one. The caller waits for the render (as it did for an in-process one): a hostile template costs
each chat request at most the time limit.

BOS: a template may print ``{{ bos_token }}`` itself (Llama 3 does). Encode the rendered text
with ``Tokenizer.encode(text)``: it does not add a second BOS when the text already starts with
one.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

import msgpack

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ntx.shared.errors import NtxError

__all__ = ["ChatTemplate", "CHATML_TEMPLATE"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


RENDER_TIME_LIMIT_S = 2.0  # wall time of one render, from the request's send to the reply's end
RENDER_WORKER_START_S = 60.0  # the worker's own start (an interpreter and jinja2), not a render's time
RENDER_MEMORY_LIMIT_BYTES = 256 << 20  # address space a render may add to the worker's
# The prompt a render may write: a prompt is refused beyond 32 bytes per context token before it
# is tokenized (ctl/request_limits.py), so this only stops a runaway template early.
RENDER_OUTPUT_LIMIT_CHARS = 4 << 20


class _TemplateRaised(Exception):
    """raise_exception() from inside a template (kept apart from Jinja's own errors)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Sandbox where touching an unsafe attribute raises immediately (the stock sandbox returns
    an Undefined that only raises when used further)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ChatTemplate:
    """A compiled chat template. ``template_str=None`` (or empty) uses ChatML. It is compiled
    here, so that a template that does not parse fails where it is loaded, and rendered by the
    worker (``render``), which compiles the same source once more."""

    def __init__(self, template_str: str | None, bos_token: str = "", eos_token: str = "", *,
                 start_renderer: bool = True) -> None:
        self.is_fallback = not template_str
        self.source = template_str or CHATML_TEMPLATE
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        if start_renderer:  # it boots while the caller goes on: the first render does not wait for it
            with RENDERER.lock:
                RENDERER.start()
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise NtxError(f"chat template does not parse (line {exc.lineno}): {_one_line(exc.message or exc)}") from None
        except Exception as exc:  # noqa: BLE001 - a template nested too deep for the compiler, say
            raise NtxError(f"chat template does not parse: {type(exc).__name__}: {_one_line(exc)[:200]}") from None

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], tokenizer: Any | None = None) -> ChatTemplate:
        """The file's template (``tokenizer.chat_template``) with BOS/EOS text from the vocab."""
        bos = eos = ""
        if tokenizer is not None:
            if tokenizer.bos_id is not None:
                bos = tokenizer.vocab_piece(tokenizer.bos_id)
            if tokenizer.eos_id is not None:
                eos = tokenizer.vocab_piece(tokenizer.eos_id)
        return cls(metadata.get("tokenizer.chat_template"), bos, eos)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Prompt text for ``messages`` (each a dict with at least ``role``). ``extra`` is passed
        to the template as variables (e.g. ``tools=[...]``)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise NtxError("messages must be a list of objects with 'role' and 'content'")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise NtxError(f"message {i} has no string 'role'")
        context = {
            "tools": None,
            "documents": None,
            **extra,
            "messages": messages,
            "add_generation_prompt": bool(add_generation_prompt),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        return RENDERER.render({"source": self.source, "bos": self.bos_token, "eos": self.eos_token,
                                "context": context})

    def _render_capped(self, context: dict[str, Any]) -> str:
        """The template's text, stopped once it passes ``RENDER_OUTPUT_LIMIT_CHARS``; NtxError
        with one line for any failure."""
        try:
            parts, n_chars = [], 0
            for part in self._template.generate(**context):
                n_chars += len(part)
                if n_chars > RENDER_OUTPUT_LIMIT_CHARS:
                    raise NtxError(f"chat template wrote more than {RENDER_OUTPUT_LIMIT_CHARS} characters; stopped")
                parts.append(part)
            return "".join(parts)
        except NtxError:
            raise
        except _TemplateRaised as exc:
            raise NtxError(f"chat template refused the messages: {_one_line(exc)}") from None
        except SecurityError as exc:
            raise NtxError(f"chat template blocked by the sandbox: {_one_line(exc)}") from None
        except jinja2.TemplateError as exc:
            raise NtxError(f"chat template failed: {_one_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - the template is the file's code: any failure is the request's
            # (an overflow, a division by zero, a macro that recurses for ever, a memory error)
            raise NtxError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)[:200]}") from None



class RenderWorker:
    """The process that renders chat templates for this one (the bounds: the module's
    docstring). ``render`` sends one request and waits for its reply at most
    ``RENDER_TIME_LIMIT_S``; a worker that overran, died or ran out of memory is gone, and the
    next render starts another. Requests and replies are msgpack maps behind a 4-byte length."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.booted = False  # it said it is ready (its first byte)
        self.lock = threading.Lock()  # one render at a time, whichever thread asks

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.chat"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, close_fds=True)
        self.booted = False

    def stop(self) -> None:
        """Kill the worker (if it still runs) and forget it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
            self.proc = None

    def render(self, request: dict[str, Any]) -> str:
        """The text of ``request`` (source, bos, eos, context); NtxError with one line."""
        try:
            body = msgpack.packb(request, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise NtxError(f"messages cannot be given to the chat template: {_one_line(e)[:200]}") from None
        with self.lock:
            self.start()
            try:
                if not self.booted:
                    self._read(1, time.monotonic() + RENDER_WORKER_START_S, "start")
                    self.booted = True
                deadline_s = time.monotonic() + RENDER_TIME_LIMIT_S
                self._write(len(body).to_bytes(4, "little") + body, deadline_s)
                n = int.from_bytes(self._read(4, deadline_s, "render"), "little")
                reply = msgpack.unpackb(self._read(n, deadline_s, "render"), raw=False)
            except NtxError:
                self.stop()
                raise
            if reply.get("exit"):  # after a MemoryError it ends itself; the next render starts another
                self.stop()
        if "error" in reply:
            raise NtxError(reply["error"])
        return reply["text"]

    def _write(self, data: bytes, deadline_s: float) -> None:
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0 or not select.select([], [fd], [], left_s)[1]:
                raise NtxError(f"chat template did not finish within {RENDER_TIME_LIMIT_S:g} s; stopped")
            try:
                view = view[os.write(fd, view):]
            except BrokenPipeError:
                raise NtxError(self._ended("render")) from None

    def _read(self, n: int, deadline_s: float, what: str) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks: list[bytes] = []
        while n:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0 or not select.select([fd], [], [], left_s)[0]:
                if what == "start":
                    raise NtxError(f"the chat template's renderer did not start within {RENDER_WORKER_START_S:g} s")
                raise NtxError(f"chat template did not finish within {RENDER_TIME_LIMIT_S:g} s; stopped")
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                raise NtxError(self._ended(what))
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _ended(self, what: str) -> str:
        code = self.proc.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"chat template failed: its renderer {how} during the {what}"


RENDERER = RenderWorker()  # the process's one renderer


def serve_renders() -> None:
    """The worker's loop (``python -m ntx.ctl.chat``): a ready byte, then one reply per request
    until its input ends (its parent closed it or died)."""
    from ntx.shared.daemon import die_with_parent

    die_with_parent()
    with open("/proc/self/statm") as f:
        limit = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + RENDER_MEMORY_LIMIT_BYTES
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    templates: dict[tuple[str, str, str], ChatTemplate] = {}
    out.write(b"R")
    out.flush()
    while len(head := inp.read(4)) == 4:
        exit_after = False
        try:
            req = msgpack.unpackb(inp.read(int.from_bytes(head, "little")), raw=False)
            key = (req["source"], req["bos"], req["eos"])
            if key not in templates:
                if len(templates) >= 8:
                    templates.clear()
                templates[key] = ChatTemplate(*key, start_renderer=False)
            reply = {"text": templates[key]._render_capped(req["context"])}
        except NtxError as e:
            reply = {"error": str(e)}
        except MemoryError:  # _render_capped turns it into an NtxError; this is one outside it
            reply, exit_after = {"error": "chat template failed: MemoryError"}, True
        if "error" in reply and "MemoryError" in reply["error"]:
            exit_after = True  # what ran out of memory may have left this process in any state
        body = msgpack.packb({**reply, "exit": exit_after}, use_bin_type=True)
        out.write(len(body).to_bytes(4, "little") + body)
        out.flush()
        if exit_after:
            return


if __name__ == "__main__":
    try:
        serve_renders()
    except BrokenPipeError:  # the parent ended (before this worker was even ready, say): nobody to answer
        os._exit(0)  # (not sys.exit: flushing stdout at exit would fail again, with a traceback)
