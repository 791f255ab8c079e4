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
from inspect import Parameter, Signature, signature  # (the module name is taken: `ntxctl inspect`)
from typing import Optional

import typer

from ntx.shared.errors import NtxError
from ntx.shared.sampling_fields import SAMPLING_FIELDS, to_wire

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="ntx: run Llama-family GGUF models larger than the GPU by streaming layers through daemons.",
)

DEFAULT_LISTEN = "tcp://127.0.0.1:5555"


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"ntxctl: error: {message}", err=True)
    raise typer.Exit(code)


def _model_path(model: Optional[str]) -> str:
    if model:
        return model
    from ntx.ctl.models import ensure_default_model

    return str(ensure_default_model())


@app.command()
def pull(force: bool = typer.Option(False, "--force", help="download again even if cached")) -> None:
    """Fetch the default model (SmolLM2-135M-Instruct Q4_1) into the user's cache."""
    from ntx.ctl.models import pull_default_model

    path = pull_default_model(progress=True, force=force)
    typer.echo(f"default model ready: {path}")


@app.command()
def inspect(model: Optional[str] = typer.Argument(None, help="GGUF file (default: the default model)")) -> None:
    """Show a model's hyper-parameters and per-layer byte spans (no tensor data is read)."""
    from ntx.shared.gguf_index import open_model

    idx = open_model(_model_path(model))
    hp = idx.hparams
    typer.echo(f"{idx.name}  ({idx.architecture}, GGUF v{idx.version}, {idx.file_type}, {len(idx.paths)} file(s))")
    for k, v in vars(hp).items():
        typer.echo(f"  {k:16s} {v}")
    typer.echo(f"  layer bytes      {idx.layer_bytes_total / 2**20:.1f} MiB in {hp.n_layers} layers "
               f"(largest slot {idx.max_layer_slot_bytes / 2**20:.2f} MiB)")
    typer.echo(f"  global bytes     {idx.global_bytes_total / 2**20:.1f} MiB ({', '.join(idx.globals)})")


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


_JSON_KEYS = ("text", "tokens", "prompt_tokens", "finish_reason", "timings", "usage", "seed")


def _print_stream(events, as_json: bool) -> dict:
    """Write token texts as they come (unless --json); return the ``done`` event. Local and
    remote generations both end here, so they print exactly alike."""
    done: dict = {}
    for ev in events:
        if ev["type"] == "token" and not as_json:
            sys.stdout.write(ev["text"])
            sys.stdout.flush()
        elif ev["type"] == "done":
            done = ev
            if not as_json:
                sys.stdout.write(ev.get("tail", "") + "\n")
                sys.stdout.flush()
        elif ev["type"] == "error":
            _fail(f"{ev.get('code')}: {ev.get('message')}")
    return done


def _print_json(done: dict) -> None:
    typer.echo(json.dumps({k: done[k] for k in _JSON_KEYS if k in done}))


def _local_events(engine):
    while engine.has_work:
        yield from engine.step()


def _generate_local(model_path, prompt, raw, params, as_json, speculative: bool, drafting: dict) -> None:
    from ntx.ctl.local import build_local_engine
    from ntx.daemons.compute.engine import Request

    t0 = time.monotonic()
    engine = build_local_engine(model_path, progress=True, **drafting)
    load_s = time.monotonic() - t0
    ids = engine.prompt_tokens(prompt=prompt, raw=raw)
    engine.submit(Request(id="cli", prompt_tokens=ids, params=params, stream=not as_json, speculative=speculative))
    done = _print_stream(_local_events(engine), as_json)
    if as_json:
        done["timings"]["load_s"] = round(load_s, 3)
        _print_json(done)


@app.command()
@sampling_options()
def generate(
    prompt: str = typer.Argument(..., help="the prompt (a user message, or raw text with --raw)"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file (default: SmolLM2-135M, pulled on first use)"),
    raw: bool = typer.Option(False, "--raw", help="the prompt is raw text: no chat template"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    listen: str = typer.Option(DEFAULT_LISTEN, "--listen", help="address of a running pipeline"),
    local: bool = typer.Option(False, "--local", help="run in this process on the CPU, even if a pipeline is running"),
    speculative: bool = typer.Option(True, "--speculative/--no-speculative",
                                     help="draft and verify when the engine has a drafter"),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="in-process: draft with this small GGUF (same vocabulary)"),
    self_draft: Optional[str] = typer.Option(None, "--self-draft", help="in-process: draft with these layers of the model (e.g. 0-9, or all)"),
    self_draft_skip: Optional[str] = typer.Option(None, "--self-draft-skip", help="in-process: draft without these layers "
                                                  "(a list, a calibrate profile, or PROFILE:N, its N most similar)"),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="in-process: tokens drafted per pass (1-512)"),
    draft_width: str = typer.Option("auto", "--draft-width", help="in-process: the draft tree's width, or auto"),
    sampling=None,  # SamplingParams, from the options @sampling_options adds
) -> None:
    """Generate text: through a running pipeline if one listens, else in this process (CPU)."""
    drafting = _drafting(draft_model, self_draft, draft_tokens, draft_width, self_draft_skip, model)
    if not local:
        from ntx.ctl.client import pipeline_available

        if pipeline_available(listen):
            _generate_remote(listen, prompt, raw, sampling, as_json, speculative)
            return
        typer.echo(
            f"ntxctl: no pipeline listens on {listen}; running in this process on the CPU "
            "(start a pipeline with `ntxctl start`)",
            err=True,
        )
    _generate_local(_model_path(model), prompt, raw, sampling, as_json, speculative, drafting)


def _drafting(draft_model: str | None, self_draft: str | None, draft_tokens: int, draft_width: str,
              self_draft_skip: str | None = None, model: str | None = None) -> dict:
    """``build_engine``'s drafter keywords from the CLI's (``--self-draft all`` or a layer list,
    ``--self-draft-skip`` as ``--skip-layers`` reads it, ``--draft-width auto`` or a number)."""
    from ntx.shared.config import parse_layers

    if draft_width != "auto" and not draft_width.isdigit():
        _fail(f"--draft-width {draft_width!r}: give auto or a whole number")
    out: dict = {"draft_tokens": draft_tokens, "draft_width": None if draft_width == "auto" else int(draft_width)}
    if draft_model:
        out["draft_model"] = os.path.abspath(draft_model)
    if self_draft:
        out["self_draft"] = True if self_draft == "all" else parse_layers(self_draft, "--self-draft")
    if self_draft_skip:
        from ntx.ctl.calibrate import skip_layers
        from ntx.shared.gguf_index import open_model

        n_layers = open_model(_model_path(model)).hparams.n_layers
        out["self_draft_skip"] = skip_layers(self_draft_skip, n_layers, "--self-draft-skip")
        out.setdefault("self_draft", True)
    return out


def _stream_remote(client, as_json: bool, **request) -> dict:
    return _print_stream(client.generate(stream=not as_json, **request), as_json)


def _generate_remote(listen: str, prompt: str, raw: bool, params, as_json: bool, speculative: bool = True) -> None:
    from ntx.ctl.client import Client

    extra = {} if speculative else {"speculative": False}
    with Client(listen) as c:
        done = _stream_remote(c, as_json, prompt=prompt, raw=raw, **to_wire(params), **extra)
    if as_json:
        _print_json(done)


@app.command()
@sampling_options(temperature=0.7, max_tokens=512)
def chat(
    listen: str = typer.Option(DEFAULT_LISTEN, "--listen", help="address of a running pipeline"),
    system: Optional[str] = typer.Option(None, "--system", help="system message"),
    sampling=None,  # SamplingParams, from the options @sampling_options adds
) -> None:
    """Talk to a running pipeline turn by turn; the conversation is kept. Ctrl-D or /exit ends it."""
    from ntx.ctl.client import Client, pipeline_available

    if not pipeline_available(listen):
        _fail(f"no pipeline listens on {listen}: start one with `ntxctl start`")
    messages = [{"role": "system", "content": system}] if system else []
    with Client(listen) as c:
        while True:
            try:
                line = input("> ")
            except EOFError:
                typer.echo("")
                return
            if line.strip() in ("/exit", "/quit"):
                return
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            done = _stream_remote(c, False, messages=messages, **to_wire(sampling))
            messages.append({"role": "assistant", "content": done.get("text", "")})


@app.command()
def start(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file (default: SmolLM2-135M, pulled on first use)"),
    name: str = typer.Option("default", "--name", help="instance name (several can run side by side)"),
    backend: str = typer.Option("auto", "--backend", help="cuda, cpu or auto (cuda when a GPU and cupy are present)"),
    listen: str = typer.Option(DEFAULT_LISTEN, "--listen", help="client address (ZeroMQ ROUTER)"),
    slots: int = typer.Option(2, "--slots", help="ring slots per side (2 = double buffering)"),
    vram_budget: Optional[str] = typer.Option(None, "--vram-budget", help="e.g. 24GiB (default: free device memory)"),
    ram_budget: Optional[str] = typer.Option(None, "--ram-budget", help="pinned RAM for layers, e.g. 64GiB"),
    gpu_layers: Optional[int] = typer.Option(None, "--gpu-layers", help="at most this many resident layers"),
    io: str = typer.Option("auto", "--io", help="storage reads: auto, direct, buffered or mmap"),
    max_batch: int = typer.Option(16, "--max-batch", help="sequences advanced per pass"),
    ctx: int = typer.Option(4096, "--ctx", help="context length per sequence"),
    plan_only: bool = typer.Option(False, "--plan-only", help="print the tier plan and start nothing"),
    timeout: float = typer.Option(120.0, "--timeout", help="seconds each daemon may take to get ready"),
    max_restarts: int = typer.Option(3, "--max-restarts", help="restarts within 5 minutes before giving up"),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="draft with this small GGUF (same vocabulary), resident"),
    self_draft: Optional[str] = typer.Option(None, "--self-draft", help="draft with resident layers of the model: all, or a list (0-9,12)"),
    self_draft_skip: Optional[str] = typer.Option(None, "--self-draft-skip", help="draft without these layers: a list, "
                                                  "a calibrate profile, or PROFILE:N (its N most similar layers)"),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="tokens drafted per sequence and pass (1-512)"),
    draft_width: str = typer.Option("auto", "--draft-width", help="the draft tree's width (1 = a chain), or auto: "
                                    "chosen from measured acceptance"),
    draft_replay: Optional[str] = typer.Option(
        None, "--draft-replay", help="for benchmarks: draft a recorded greedy continuation (JSON from `ntxctl bench "
        "--scenarios spec`); the drafter named otherwise runs and is ignored"),
    draft_replay_p: float = typer.Option(0.0, "--draft-replay-p", help="for benchmarks: probability that each "
                                         "replayed draft token is made wrong"),
    curve_server_key: Optional[str] = typer.Option(None, "--curve-server-key", help="CURVE: the server's secret key "
                                                   "file (`ntxctl keygen`); required when --listen is not loopback"),
    curve_clients: Optional[str] = typer.Option(None, "--curve-clients", help="CURVE: folder of the public key "
                                                "files (NAME.key) of the clients let in"),
) -> None:
    """Start the pipeline (supervisor + reader, dma and compute daemons) in the background."""
    from ntx.ctl import instance
    from ntx.shared.config import InstanceConfig, parse_size
    from ntx.shared.gguf_index import open_model
    from ntx.daemons.compute.backend import plan_for

    model_path = os.path.abspath(_model_path(model))
    cfg = InstanceConfig(
        model=model_path, name=name, backend=_choose_backend(backend), listen=listen, slots=slots,
        vram_budget=parse_size(vram_budget, "--vram-budget") if vram_budget is not None else None,
        ram_budget=parse_size(ram_budget, "--ram-budget") if ram_budget is not None else None,
        max_vram_layers=gpu_layers, io_mode=io, max_batch=max_batch, max_context=ctx,
        handshake_timeout_s=timeout, max_restarts=max_restarts,
        **_instance_drafting(_drafting(draft_model, self_draft, draft_tokens, draft_width, self_draft_skip, model)),
        draft_replay=_replay_path(draft_replay), draft_replay_p_wrong=draft_replay_p,
        curve_server_key=os.path.abspath(curve_server_key) if curve_server_key else None,
        curve_clients=os.path.abspath(curve_clients) if curve_clients else None,
    ).validate()
    index = open_model(model_path)
    cfg.max_context = min(cfg.max_context, index.hparams.n_ctx_train)
    plan = plan_for(index, cfg)
    typer.echo(f"model {index.name} ({index.file_type}, {index.hparams.n_layers} layers) on {cfg.backend}")
    for line in plan.describe():
        typer.echo(f"  {line}")
    if plan_only:
        return

    def progress(st):
        ready = [n for n, d in st.get("daemons", {}).items() if d["state"] == "ready"]
        typer.echo(f"  starting… ready: {', '.join(ready) or 'none yet'}", err=True)

    st = instance.start(cfg, plan, on_progress=progress)
    pids = ", ".join(f"{n} {d['pid']}" for n, d in st["daemons"].items())
    typer.echo(f"instance {name!r} ready on {listen} (supervisor {st['supervisor_pid']}; {pids})")


def _instance_drafting(drafting: dict) -> dict:
    """``_drafting``'s keywords as InstanceConfig fields."""
    self_draft = drafting.get("self_draft", False)
    return {"draft_model": drafting.get("draft_model"), "self_draft": self_draft is not False,
            "self_draft_layers": None if self_draft in (True, False) else self_draft,
            "self_draft_skip": drafting.get("self_draft_skip"),
            "draft_tokens": drafting["draft_tokens"], "draft_width": drafting["draft_width"]}


def _replay_path(path: str | None) -> str | None:
    """``--draft-replay``'s file, read here first so that a bad one is one line, not a failed daemon."""
    if path is None:
        return None
    from ntx.daemons.compute.replay import load_references

    load_references(path)
    return os.path.abspath(path)


def _choose_backend(backend: str) -> str:
    if backend in ("cpu", "cuda"):
        if backend == "cuda":
            from ntx.daemons.compute.cuda_check import require_cuda

            require_cuda()
        return backend
    if backend != "auto":
        _fail(f"--backend {backend!r}: choose cuda, cpu or auto")
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
    name: str = typer.Option("default", "--name"),
    force: bool = typer.Option(False, "--force", help="cancel in-flight requests instead of finishing them"),
) -> None:
    """Stop an instance: finish (or with --force cancel) in-flight requests, free every resource."""
    from ntx.ctl import instance

    typer.echo(instance.stop(name, force=force))


@app.command()
def status(
    name: str = typer.Option("default", "--name"),
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
            others = instance.list_instances()
            hint = f" (running: {', '.join(others)})" if others else ""
            failure = instance.last_failure(name)
            if failure:
                hint += f"; it stopped because: {failure}"
            hint += f"; start it with `ntxctl start --name {name}`"
            _fail(f"instance {name!r} is not running{hint}")
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
def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="the streamed model (e.g. a 70B-shape GGUF)"),
    backend: str = typer.Option("auto", "--backend"),
    vram_budget: Optional[str] = typer.Option(None, "--vram-budget", help="for (a), (b), (c): e.g. 24GiB"),
    gpu_layers: Optional[int] = typer.Option(None, "--gpu-layers"),
    ram_budget: Optional[str] = typer.Option(None, "--ram-budget", help="for (a); (b) uses 0"),
    tokens: int = typer.Option(8, "--tokens", help="tokens generated per request"),
    batch: int = typer.Option(1, "--batch", help="concurrent requests"),
    scenarios: str = typer.Option("a,b,c,check", "--scenarios", help="any of a,b,c,d,check,spec"),
    resident_model: Optional[str] = typer.Option(None, "--resident-model", help="model for (d), e.g. an 8B shape"),
    out: str = typer.Option("bench-out", "--out", help="folder for bench.json and bench.png"),
    listen: str = typer.Option("tcp://127.0.0.1:5590", "--listen"),
    spec_verify_draft_tokens: str = typer.Option("1,8,32,128,512", "--spec-verify-draft-tokens",
                                                 help="spec: chain lengths whose verify pass is timed"),
    spec_verify_passes: int = typer.Option(2, "--spec-verify-passes", help="spec: timed verify passes per chain length"),
    spec_accept_draft_tokens: int = typer.Option(8, "--spec-accept-draft-tokens",
                                                 help="spec: tokens drafted per pass at controlled acceptance"),
    spec_accept_length: float = typer.Option(6.0, "--spec-accept-length",
                                             help="spec: expected accepted tokens per pass (sets the replay's p)"),
    spec_tokens: int = typer.Option(64, "--spec-tokens", help="spec: tokens generated per controlled-acceptance run"),
    draft_model: Optional[str] = typer.Option(None, "--draft-model",
                                              help="spec: run this draft model behind the replay (its cost paid)"),
) -> None:
    """Streaming benchmark: (a) VRAM + pinned RAM, (b) VRAM + storage, (c) naive mmap, (d) resident,
    (spec) speculative decoding with the replay drafter; every figure printed next to the limit
    measured in the same run."""
    from pathlib import Path

    from ntx.ctl.bench import SpecOptions, run_bench
    from ntx.shared.config import parse_size

    run_bench(
        os.path.abspath(_model_path(model)), backend=_choose_backend(backend),
        vram_budget=parse_size(vram_budget, "--vram-budget") if vram_budget else None, gpu_layers=gpu_layers,
        ram_budget=parse_size(ram_budget, "--ram-budget") if ram_budget else None, tokens=tokens, batch=batch,
        scenarios=[s.strip() for s in scenarios.split(",") if s.strip()], resident_model=resident_model,
        out_dir=Path(out), listen=listen, log=lambda s: typer.echo(s),
        spec=SpecOptions(_counts(spec_verify_draft_tokens, "--spec-verify-draft-tokens"),
                         spec_verify_passes, spec_accept_draft_tokens, spec_accept_length, spec_tokens, draft_model),
    )


def _counts(text: str, what: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> (1, 8, 32)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        _fail(f"{what} {text!r}: expected whole numbers separated by commas (example: 1,8,32)")


@app.command()
def perplexity(
    file: str = typer.Argument(..., help="text file (UTF-8)"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file (default: SmolLM2-135M, pulled on first use)"),
    ctx: int = typer.Option(512, "--ctx", help="tokens per chunk; the second half of each is scored"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    backend: str = typer.Option("cpu", "--backend", help="in-process: cpu or cuda"),
    listen: str = typer.Option(DEFAULT_LISTEN, "--listen", help="address of a running pipeline"),
    local: bool = typer.Option(False, "--local", help="run in this process, even if a pipeline is running"),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="score only the first N chunks"),
    skip_layers: Optional[str] = typer.Option(
        None, "--skip-layers",
        help="in-process: skip these layers (0-3,7), a profile's at cos >= 0.98 (PROFILE), or its N most similar (PROFILE:N)"),
) -> None:
    """Perplexity over FILE by llama-perplexity's method (chunks of --ctx tokens, second halves
    scored): the running value per chunk, then PPL ± its standard error. Through a running
    pipeline if one listens, else in this process."""
    from ntx.ctl import perplexity as ppl
    from ntx.ctl.client import pipeline_available
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if skip_layers is None and not local and pipeline_available(listen):
        scorer = ppl.PipelineScorer(listen, os.path.abspath(model) if model else None)
    else:
        from ntx.ctl.calibrate import skip_layers as parse_skip
        from ntx.shared.gguf_index import open_model

        model_path = _model_path(model)
        skip = parse_skip(skip_layers, open_model(model_path).hparams.n_layers) if skip_layers else None
        scorer = ppl.LocalScorer(model_path, _choose_backend(backend), skip)
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
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file (default: SmolLM2-135M, pulled on first use)"),
    ctx: int = typer.Option(512, "--ctx", help="tokens per chunk"),
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


def main() -> None:
    """Console entry point: user errors become one line and exit status 1."""
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
