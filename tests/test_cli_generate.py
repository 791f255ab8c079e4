"""``ntxctl generate`` and ``chat`` as a user runs them: the console entry point in a subprocess,
with no pipeline to talk to (an empty ``NTX_RUN_DIR``: no default instance, and neither --name
nor --listen), so they run the model in process on the CPU; an address where nothing answers is
an error, never a run in process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .pipeline_util import chat_interrupted, free_port

FRANCE = "The capital of France is"
FRANCE_IDS = [504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def ntxctl(tmp_path_factory, smollm2_path):
    run_dir = tmp_path_factory.mktemp("run")
    env = dict(os.environ, NTX_RUN_DIR=str(run_dir))

    def run(*args: str, model: bool = True, timeout: float = 300, input: str | None = None) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "ntx.ctl.cli", *args]
        if args and args[0] in ("generate", "chat"):
            argv += ["--model", str(smollm2_path)] if model else []
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, input=input)

    return run


def test_generate_prints_paris(ntxctl):
    r = ntxctl("generate", "--raw", "--temperature", "0", "--max-tokens", "8", FRANCE)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Traceback" not in r.stderr
    # it says it runs in process, and why
    assert r.stderr.startswith("ntxctl: instance 'default' is not running; running in this process on the CPU")


def test_the_prompt_from_stdin_or_a_file(ntxctl, tmp_path):
    """``generate -`` reads stdin and ``--file F`` reads F: the same text as the argument."""
    flags = ("--raw", "--temperature", "0", "--max-tokens", "3", "--json")
    path = tmp_path / "prompt.txt"
    path.write_text(FRANCE)
    for args, stdin in ((("-",), FRANCE), (("--file", str(path)), None)):
        r = ntxctl("generate", *flags, *args, input=stdin)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["prompt_tokens"] == FRANCE_IDS
    for args, says in ((("--file", str(path), FRANCE), "give the prompt once"), ((), "give a PROMPT, - to read it"),
                       (("--file", str(tmp_path / "none.txt")), "cannot read it as UTF-8 text")):
        r = ntxctl("generate", *flags, *args)
        assert r.returncode == 1 and r.stdout == "" and r.stderr.startswith("ntxctl: error: ") and says in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr


def test_generate_ctx_bounds_the_sequence(ntxctl):
    r = ntxctl("generate", "--raw", "--temperature", "0", "--max-tokens", "20", "--json", "--ctx", "8", FRANCE)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and len(out["tokens"]) == 8 - len(FRANCE_IDS), out
    r = ntxctl("generate", "--ctx", "100000", FRANCE)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.splitlines()[-1] == (
        "ntxctl: error: --ctx 100000: longer than the 8192 positions the model was trained for; give --ctx 8192 or "
        "less, or leave it out")


def test_an_address_where_nothing_answers_is_an_error_not_a_run_in_process(ntxctl):
    listen = f"tcp://127.0.0.1:{free_port()}"
    r = ntxctl("generate", "--listen", listen, "--max-tokens", "2", FRANCE)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == (f"ntxctl: error: the pipeline does not answer on {listen} within 5 s: check the address, or "
                        f"start a pipeline there with `ntxctl start --listen {listen}`\n")
    r = ntxctl("generate", "--listen", "nonsense", "--max-tokens", "2", FRANCE)
    assert r.returncode == 1 and r.stderr.startswith("ntxctl: error: --listen 'nonsense': not an address ZeroMQ can")


def test_generate_json(ntxctl):
    r = ntxctl("generate", "--raw", "--temperature", "0", "--max-tokens", "8", "--json", FRANCE)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout  # one JSON object, no streamed text
    out = json.loads(lines[0])
    assert out["text"].startswith(" Paris")
    assert out["prompt_tokens"] == FRANCE_IDS
    assert len(out["tokens"]) == 8 and out["tokens"][0] == 7042
    assert out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 8}
    assert out["timings"]["load_s"] > 0
    assert {"prefill_s", "decode_s"} <= set(out["timings"])


def test_generate_drafts_without_a_model_in_process(ntxctl):
    """``--draft ngram`` in this process (as ``ntxctl start`` takes it): the same greedy tokens as
    without, and ``--json`` says what was drafted and accepted."""
    text = "Repeat: the cat sat on the mat. the cat sat on the mat. the cat"
    flags = ("--raw", "--temperature", "0", "--max-tokens", "24", "--json", text)
    plain, spec = (ntxctl("generate", *extra, *flags) for extra in ((), ("--draft", "ngram", "--draft-tokens", "8")))
    assert plain.returncode == 0 and spec.returncode == 0, (plain.stderr, spec.stderr)
    plain, spec = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec["tokens"] == plain["tokens"] and "speculation" not in plain
    assert spec["speculation"]["verify_passes"] > 0 and spec["speculation"]["accepted"] > 0, spec["speculation"]
    r = ntxctl("generate", "--draft", "ngrams", FRANCE)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == "ntxctl: error: --draft ngrams: choose ngram, suffix or lookahead", r.stderr


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--top-p", "7"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-p", "abc"], "--top-p"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flags_are_one_error_line(ntxctl, flags, needle):
    r = ntxctl("generate", *flags, FRANCE)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ntxctl: error: ") and needle in lines[0]
    assert r.stdout == ""


def test_bad_model_path_is_one_error_line(ntxctl, tmp_path):
    r = ntxctl("generate", "--model", str(tmp_path / "missing.gguf"), "--raw", FRANCE, model=False)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ntxctl: error: ")]
    assert len(errors) == 1 and "missing.gguf: no such file" in errors[0]
    assert r.stdout == ""


def _replies(stdout: str) -> list[str]:
    """chat's output lines without its prompts ("> ", and "... " inside a message of several lines)."""
    return [re.sub(r"^(> |\.\.\. )+", "", line) for line in stdout.splitlines()]


def test_chat_runs_in_process_and_keeps_its_commands_from_the_model(ntxctl):
    """With no pipeline, chat runs the model in this process as generate does. /help lists the
    commands, a mistyped command is one line naming them, /clear forgets the conversation (the
    same question then gets the same greedy answer), a message of several lines is one turn, and
    /exit ends the chat (what follows is never read)."""
    question = "What is the capital of France? Answer with the city name."  # "Paris" with a clear margin
    script = ["/help", "/nosuch", question, "/clear", question, '"""', "Name the capital of France", 'in one word."""',
              "/exit", "never read"]
    r = ntxctl("chat", "--temperature", "0", "--max-tokens", "8", input="\n".join(script) + "\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("ntxctl: instance 'default' is not running; running in this process on the CPU")
    assert [ln for ln in r.stderr.splitlines() if "/nosuch" in ln] == [
        "ntxctl: unknown command /nosuch: the commands are /help, /clear, /exit (// starts a message with /)"]
    lines = _replies(r.stdout)
    assert lines[0].startswith("/help   this list") and any(ln.startswith("/clear  forget the conversation") for ln in lines)
    first = next(i for i, ln in enumerate(lines) if "Paris" in ln)
    assert lines[first + 1] == "(the conversation is forgotten)"
    assert lines[first + 2] == lines[first], r.stdout  # the same prompt again: nothing of the first turn kept
    assert lines[first + 3].strip() and lines[first + 4:] == [""], r.stdout  # the block's reply, then the end


def test_ctrl_c_in_chat_in_process_cancels_the_reply_and_the_chat_goes_on(smollm2_path, tmp_path):
    code, err = chat_interrupted("--model", str(smollm2_path), env={"NTX_RUN_DIR": str(tmp_path)})
    assert code == 0, err  # the chat went on after the cancelled reply, and /exit ended it
    assert b"finish: cancelled" in err and b"Traceback" not in err


def test_the_seed_is_what_its_help_says(ntxctl):
    """--seed's help: a seed is drawn for each request that gives none, generate --json reports it,
    and that seed gives the same text again."""
    from typer.main import get_command

    from ntx.ctl import cli

    seed_help = next(p.help for p in get_command(cli.app).commands["generate"].params if p.name == "seed")
    assert "drawn anew for each request; generate --json reports it as seed" in seed_help
    flags = ("--temperature", "1.5", "--max-tokens", "12", "--json", "Tell me a story.")
    first = json.loads(ntxctl("generate", *flags).stdout)
    assert isinstance(first["seed"], int)
    again = json.loads(ntxctl("generate", "--seed", str(first["seed"]), *flags).stdout)
    assert again["seed"] == first["seed"] and again["tokens"] == first["tokens"]
