"""ntxctl: the command line of ntx.

Every user-caused failure (bad file, bad flag, nothing running) ends as one line on stderr and
a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import typer

from ntx.shared.errors import NtxError

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


def _sampling_params(max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop):
    from ntx.daemons.compute.sampler import SamplingParams

    p = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, max_tokens=max_tokens, stop=list(stop or []),
    )
    p.validate()
    return p


def _print_events(events, as_json: bool, out: dict) -> None:
    for ev in events:
        if ev["type"] == "token" and not as_json:
            sys.stdout.write(ev["text"])
            sys.stdout.flush()
        elif ev["type"] == "done":
            if not as_json:
                sys.stdout.write(ev.get("tail", "") + "\n")
                sys.stdout.flush()
            out["done"] = ev
        elif ev["type"] == "error":
            _fail(f"{ev.get('code')}: {ev.get('message')}")


def _generate_local(model_path, prompt, raw, params, as_json) -> None:
    from ntx.ctl.local import build_local_engine
    from ntx.daemons.compute.engine import Request

    t0 = time.monotonic()
    engine = build_local_engine(model_path, progress=True)
    load_s = time.monotonic() - t0
    ids = engine.prompt_tokens(prompt=prompt, raw=raw)
    engine.submit(Request(id="cli", prompt_tokens=ids, params=params, stream=not as_json))
    out: dict = {}
    while engine.has_work:
        _print_events(engine.step(), as_json, out)
    done = out["done"]
    if as_json:
        done["timings"]["load_s"] = round(load_s, 3)
        keys = ("text", "tokens", "prompt_tokens", "finish_reason", "timings", "usage", "seed")
        typer.echo(json.dumps({k: done[k] for k in keys if k in done}))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt (a user message, or raw text with --raw)"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file (default: SmolLM2-135M, pulled on first use)"),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n"),
    temperature: float = typer.Option(0.8, "--temperature", "-t"),
    top_k: int = typer.Option(40, "--top-k"),
    top_p: float = typer.Option(0.95, "--top-p"),
    min_p: float = typer.Option(0.05, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="stop string (repeatable)"),
    raw: bool = typer.Option(False, "--raw", help="the prompt is raw text: no chat template"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    listen: str = typer.Option(DEFAULT_LISTEN, "--listen", help="address of a running pipeline"),
    local: bool = typer.Option(False, "--local", help="run in this process on the CPU, even if a pipeline is running"),
) -> None:
    """Generate text: through a running pipeline if one listens, else in this process (CPU)."""
    params = _sampling_params(max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop)
    if not local:
        try:
            from ntx.ctl.client import pipeline_available
        except ImportError:
            pipeline_available = None
        if pipeline_available is not None and pipeline_available(listen):
            from ntx.ctl.client_cli import generate_remote

            generate_remote(listen, prompt, raw, params, as_json, model)
            return
        if pipeline_available is not None:
            typer.echo(
                f"ntxctl: no pipeline listens on {listen}; running in this process on the CPU "
                "(start one with `ntxctl start`)",
                err=True,
            )
    _generate_local(_model_path(model), prompt, raw, params, as_json)


def main() -> None:
    """Console entry point: user errors become one line and exit status 1."""
    try:
        app(standalone_mode=False)
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

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
