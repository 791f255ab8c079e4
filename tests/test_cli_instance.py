"""ntxctl against a running instance, as a user runs it (the console entry point in subprocesses):
one name for every command (--name or NTX_NAME), ps, --version, completion, serve in the
foreground, --model against another model's pipeline, the finish reason on stderr, Ctrl-C
cancelling the request in the pipeline, the per-request log line, status without Python reprs."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import pytest

from ntx.ctl import instance
from ntx.shared.config import InstancePaths

from .pipeline_util import chat_interrupted, free_port, ntxctl, running_pipeline, wait_for

FRANCE = "The capital of France is"


@pytest.fixture(scope="module")
def pipeline(smollm2_path, run_dir):
    with running_pipeline(str(smollm2_path), run_dir, name="cli") as p:
        yield p


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ntxctl: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_version_and_completion():
    r = ntxctl("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ntxctl {version('ntransformer')}"
    r = subprocess.run([sys.executable, "-m", "ntx.ctl.cli", "--show-completion", "bash"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "complete " in r.stdout


def test_ps_lists_the_running_instance(pipeline):
    r = ntxctl("ps")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == ["NAME", "STATE", "MODEL", "LISTEN", "HTTP", "PID", "UP"]
    row = next(line.split() for line in rows if line.split()[0] == "cli")
    assert row[1] == "ready" and row[2] == "SmolLM2-135M-Instruct.Q4_1.gguf" and row[3] == pipeline.listen


def test_the_name_finds_the_instance_and_the_finish_reason_is_said(pipeline):
    """NTX_NAME alone (no address) reaches the named instance; a text cut by --max-tokens says
    so on stderr; the supervisor logs one line for the request."""
    r = ntxctl("generate", "--raw", "--temperature", "0", "--max-tokens", "4", FRANCE, env={"NTX_NAME": "cli"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris")
    assert "no pipeline listens" not in r.stderr
    assert r.stderr.strip().splitlines() == ["ntxctl: finish: length: --max-tokens reached, or the context is full"]
    log = InstancePaths("cli").log_dir / "supervisor.log"
    wait_for(lambda: "prompt 5 tokens, generated 4, finish length, ttft " in log.read_text(), 10.0,
             "the request's line in supervisor.log")
    r = ntxctl("generate", "--name", "cli", "--raw", "--temperature", "0", "--max-tokens", "4", "--stop", ".",
               "The capital of France is Paris")
    assert r.returncode == 0 and r.stderr == ""  # a normal stop says nothing


def test_a_name_that_is_not_running_is_an_error_naming_it_and_the_running_ones(pipeline, tmp_path):
    """A mistyped --name (or NTX_NAME) never reaches another instance nor runs in this process:
    every command that talks to an instance by name says the name is not running and lists the
    running ones; with no name and no default instance, generate runs in this process."""
    text = tmp_path / "text.txt"
    text.write_text("Hello there. " * 20)
    log = InstancePaths("cli").log_dir / "supervisor.log"
    served_before = log.read_text().count(", finish ")
    for argv, env in ((("generate", "--name", "nosuch", "--max-tokens", "2", "hi"), None),
                      (("generate", "--max-tokens", "2", "hi"), {"NTX_NAME": "nosuch"}),
                      (("chat", "--name", "nosuch"), None),
                      (("perplexity", str(text), "--name", "nosuch"), None)):
        r = ntxctl(*argv, env=env)
        line = _one_error_line(r)
        assert "instance 'nosuch' is not running (running: cli)" in line and "ntxctl start --name nosuch" in line
        assert r.stdout == "" and "in this process" not in r.stderr, r.stderr
    assert log.read_text().count(", finish ") == served_before  # nothing reached the running instance
    r = ntxctl("generate", "--raw", "--temperature", "0", "--max-tokens", "2", FRANCE)  # no name, no default
    assert r.returncode == 0 and r.stdout.startswith(" Paris"), r.stderr
    assert r.stderr.startswith("ntxctl: instance 'default' is not running (running: cli; give --name); running in "
                               "this process on the CPU"), r.stderr


def test_model_of_another_pipeline_is_an_error(pipeline, tmp_path):
    other = tmp_path / "other.gguf"
    r = ntxctl("generate", "--name", "cli", "--model", str(other), FRANCE)
    line = _one_error_line(r)
    assert f"runs {pipeline.status()['model']}, not {other}" in line
    assert r.stdout == ""
    r = ntxctl("generate", "--name", "cli", "--ctx", "512", FRANCE)  # the pipeline's context is its own
    line = _one_error_line(r)
    assert f"--ctx is for a run in this process; the pipeline on {pipeline.listen} has the context" in line
    r = ntxctl("generate", "--name", "cli", "--draft", "ngram", "--draft-tokens", "8", FRANCE)  # and its drafter
    line = _one_error_line(r)
    assert f"--draft is for a run in this process; the pipeline on {pipeline.listen} drafts as it was started" in line
    assert "leave out --draft and --draft-tokens, or pass --local" in line


def test_ctrl_c_cancels_the_request_in_the_pipeline(pipeline):
    proc, _ = _start_generating("--name", "cli", "--max-tokens", "3000", *NEVER_ENDS)
    try:
        # (the supervisor's count has been seen at 0 for a moment after the first tokens printed:
        # wait for it rather than read it once)
        wait_for(lambda: pipeline.status()["requests"]["in_flight"] == 1, 5.0, "the request in flight at the pipeline")
        proc.send_signal(signal.SIGINT)
        interrupted_s = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert b"finish: cancelled" in err and b"Traceback" not in err
    wait_for(lambda: pipeline.status()["requests"]["in_flight"] == 0, 1.0, "the request to be gone from the pipeline")
    assert time.monotonic() - interrupted_s < 5.0


def test_ctrl_c_in_chat_cancels_the_reply_and_the_chat_goes_on(pipeline):
    code, err = chat_interrupted("--name", "cli", after_interrupt=lambda: wait_for(
        lambda: pipeline.status()["requests"]["in_flight"] == 0, 10.0, "the reply to be cancelled"))
    assert code == 0, err  # the chat went on after the cancelled reply, and /exit ended it
    assert b"finish: cancelled" in err and b"Traceback" not in err


def test_chat_sends_the_model_messages_only(pipeline):
    """Through a pipeline, chat's commands never reach it: the supervisor logs one request per
    message; after /clear a question is sent alone again (as many prompt tokens as the first
    time), without it the conversation is kept (more); a message of several lines is one message,
    its lines joined as typed."""
    log = InstancePaths("cli").log_dir / "supervisor.log"
    before = len(log.read_text().splitlines())
    question = "What is the capital of France?"
    script = [question, "/help", "/nosuch", "/clear", question, question, "/clear", '"""Name the capital', 'of France."""',
              "/exit"]
    r = ntxctl("chat", "--name", "cli", "--temperature", "0", "--max-tokens", "4", input="\n".join(script) + "\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "in this process" not in r.stderr

    def prompts() -> list[int]:
        new = log.read_text().splitlines()[before:]
        return [int(m.group(1)) for ln in new if (m := re.search(r"prompt (\d+) tokens, generated", ln))]

    counts = wait_for(lambda: len(prompts()) >= 4 and prompts(), 10.0, "four requests in supervisor.log")
    assert len(counts) == 4, counts
    alone = json.loads(ntxctl("generate", "--name", "cli", "--json", "--max-tokens", "1", question).stdout)
    block = json.loads(ntxctl("generate", "--name", "cli", "--json", "--max-tokens", "1",
                              "Name the capital\nof France.").stdout)
    assert counts[0] == counts[1] == len(alone["prompt_tokens"]) < counts[2]
    assert counts[3] == len(block["prompt_tokens"])


# A request that runs until it is cancelled: greedy counting meets no end of text. (A sampled
# "very long story" once ended after 24 tokens, before the forced stop looked for it: CI failed.)
NEVER_ENDS = ("--raw", "--temperature", "0", "1, 2, 3, 4, 5,")


def _start_generating(*args: str) -> tuple[subprocess.Popen, bytes]:
    """``ntxctl generate ARGS`` in a subprocess, once it has printed some text."""
    proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.cli", "generate", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = b""
    deadline = time.monotonic() + 120
    while len(out.strip()) < 3 and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            out += os.read(proc.stdout.fileno(), 4096)
    return proc, out


def test_a_forced_stop_ends_the_text_before_the_error_line(smollm2_path, run_dir):
    with running_pipeline(str(smollm2_path), run_dir, name="forced"):
        proc, _ = _start_generating("--name", "forced", "--max-tokens", "3000", *NEVER_ENDS)
        try:
            stopped = ntxctl("stop", "--name", "forced", "--force")
            assert stopped.returncode == 0
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert stopped.stderr == "ntxctl: cancelling 1 request in flight\n"
    assert proc.returncode == 1
    assert out.endswith(b"\n")  # the text's line is ended before the error is said
    assert err.decode().strip().splitlines()[-1].startswith("ntxctl: error: shutdown: ")


def test_a_graceful_stop_says_what_it_waits_for(smollm2_path, run_dir):
    """The requests in flight, how many, and that --force cancels them; the request finishes."""
    with running_pipeline(str(smollm2_path), run_dir, name="graceful"):
        proc, _ = _start_generating("--name", "graceful", "--max-tokens", "200", "--raw", "--temperature", "0",
                                    "Once upon a time")
        try:
            stopped = ntxctl("stop", "--name", "graceful")
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert stopped.returncode == 0 and stopped.stdout == "instance 'graceful' stopped\n", stopped
    lines = stopped.stderr.splitlines()
    assert lines[0] == ("ntxctl: waiting for 1 request in flight to finish (at most 30 s); "
                        "`ntxctl stop --name graceful --force` cancels them instead"), stopped.stderr
    assert proc.returncode == 0 and b"cancelled" not in err and b"error" not in err, err  # it finished


def test_status_reads_as_text_and_names_the_logs(pipeline):
    r = ntxctl("status", env={"NTX_NAME": "cli", "COLUMNS": "400"})  # wide: no wrapped lines
    assert r.returncode == 0, r.stderr
    assert "None" not in r.stdout and "{'" not in r.stdout
    assert f"logs  {InstancePaths('cli').log_dir}\n" in r.stdout
    assert "slots: 2 × 2.12 MiB per side\n" in r.stdout  # every layer resident: no host slots to show
    assert "kernels pdl=on,pdl-matmul=off,cpu-quantized=on,batch-invariant=off\n" in r.stdout  # the instance's --kernels, defaults here


def test_status_figures_are_true_while_compute_works(pipeline):
    """Every layer resident (nothing streams): compute's clock still charges each pass its time,
    so status shows compute busy in its recent passes and its last complete pass took time."""
    with pipeline.client() as c:
        rid = c.submit("1, 2, 3, 4, 5,", raw=True, temperature=0, max_tokens=2000)  # counts on, never stops
        try:
            st = pipeline.wait_status(lambda st: st["requests"]["active"] >= 1 and
                                      st["stages"]["compute"]["recent"]["n_passes"] >= 4,
                                      "compute's status to show a few passes of the request")
            compute = st["stages"]["compute"]
            recent = [compute["passes"][k] for k in sorted(compute["passes"], key=int)[:-1]]
            assert compute["recent"]["busy"] > 0 and all(p["busy"] > 0 for p in recent if p["rows"]), compute
            assert st["bottleneck"] == "compute"
            r = ntxctl("status", "--name", "cli")
            assert r.returncode == 0, r.stderr
            line = next(ln for ln in r.stdout.splitlines() if "compute last complete pass #" in ln)
            assert float(line.split(": ")[1].split("s busy")[0]) > 0, line
        finally:
            c.cancel(rid)


def test_a_port_in_use_names_the_fix(pipeline, smollm2_path):
    """The hint's value works: a port free now, in the form the option reads (--http takes
    HOST:PORT, not a tcp:// address)."""
    r = ntxctl("start", "--model", str(smollm2_path), "--name", "clash", "--backend", "cpu", "--listen", pipeline.listen)
    line = _one_error_line(r)
    assert f"--listen {pipeline.listen}: cannot listen there" in line and "pick another" in line
    suggested = line.rpartition("e.g. --listen ")[2]
    assert suggested.startswith("tcp://127.0.0.1:") and _can_listen(int(suggested.rpartition(":")[2])), line
    assert instance.supervisor_pid(InstancePaths("clash")) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http = f"127.0.0.1:{taken.getsockname()[1]}"
        r = ntxctl("start", "--model", str(smollm2_path), "--name", "clash", "--backend", "cpu",
                   "--listen", f"tcp://127.0.0.1:{free_port()}", "--http", http)
        line = _one_error_line(r)
        assert f"--http {http}: cannot listen there" in line, line
        suggested = line.rpartition("e.g. --http ")[2]
        assert suggested.startswith("127.0.0.1:") and _can_listen(int(suggested.rpartition(":")[2])), line
        r = ntxctl("start", "--model", str(smollm2_path), "--backend", "cpu", "--plan-only", "--http", suggested)
        assert r.returncode == 0, r.stderr  # the address the hint gives is one --http takes
    assert instance.supervisor_pid(InstancePaths("clash")) is None


def _can_listen(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_plan_only_needs_no_free_name_or_port(pipeline, smollm2_path):
    """A plan starts nothing: the running instance's name and port, and the default port the
    test run holds (tests/conftest.py), do not stop it."""
    st = pipeline.status()
    for args in (("--name", "cli", "--listen", pipeline.listen), ()):
        r = ntxctl("start", "--model", str(smollm2_path), "--backend", "cpu", "--plan-only", *args)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert "(Q4_1, 30 layers) on cpu" in r.stdout and "  kernels " in r.stdout
    assert pipeline.status()["supervisor_pid"] == st["supervisor_pid"]  # the running one is left alone


def test_serve_runs_in_the_foreground_and_stops_on_sigterm(smollm2_path, run_dir, tmp_path):
    listen = f"tcp://127.0.0.1:{free_port()}"
    err_path = tmp_path / "serve.stderr"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.cli", "serve", "--model", str(smollm2_path),
                                 "--backend", "cpu", "--listen", listen, "--name", "fg"],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: (instance.get_status("fg", timeout_s=1.0) or {}).get("state") == "ready", 120.0,
                 "the foreground instance to be ready")
        assert instance.supervisor_pid(InstancePaths("fg")) == proc.pid  # this process is the supervisor
        r = ntxctl("generate", "--raw", "--temperature", "0", "--max-tokens", "3", FRANCE, env={"NTX_NAME": "fg"})
        assert r.returncode == 0 and r.stdout.startswith(" Paris")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    log = err_path.read_text()
    assert "gen 0: compute ready" in log and "generated 3, finish length" in log  # logs went to stderr
    assert not (InstancePaths("fg").log_dir / "supervisor.log").exists()
    assert instance.leftovers("fg") == []
