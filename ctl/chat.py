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
an exception must end the one request, never the loop. (Time and size bounds on a render are
not here yet.)

BOS: a template may print ``{{ bos_token }}`` itself (Llama 3 does). Encode the rendered text
with ``Tokenizer.encode(text)``: it does not add a second BOS when the text already starts with
one.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

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
    """A compiled chat template. ``template_str=None`` (or empty) uses ChatML."""

    def __init__(self, template_str: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.is_fallback = not template_str
        self.source = template_str or CHATML_TEMPLATE
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise NtxError(f"chat template does not parse (line {exc.lineno}): {_one_line(exc.message or exc)}") from None

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
        try:
            return self._template.render(**context)
        except _TemplateRaised as exc:
            raise NtxError(f"chat template refused the messages: {_one_line(exc)}") from None
        except SecurityError as exc:
            raise NtxError(f"chat template blocked by the sandbox: {_one_line(exc)}") from None
        except jinja2.TemplateError as exc:
            raise NtxError(f"chat template failed: {_one_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - the template is the file's code: any failure is the request's
            # (an overflow, a division by zero, a macro that recurses for ever, a memory error)
            raise NtxError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)[:200]}") from None
