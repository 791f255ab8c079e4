"""The daemon pipeline on the CPU backend, with real processes, shared memory and sockets.

Every acceptance point of the pipeline issue: streamed passes equal the in-process reference
(storage-only, mixed tiers, 2 and 3 slots), status names every stage and a bottleneck, eight
concurrent clients, kill -9 of each daemon, nothing left after stop, bad input on the wire.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import threading

import msgpack
import pytest

from ntx.ctl import instance
from ntx.ctl.client import Client, ClientError
from ntx.ctl.local import build_local_engine
from ntx.daemons.compute.sampler import SamplingParams
from ntx.shared.messages import EngineRequest

from .pipeline_util import Pipeline, free_port, ntxctl, own_instance, running_pipeline, wait_for

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "import numpy as np\n",
    "My favourite fruit is",
    "The largest planet in the solar system is",
]
N_TOKENS = 6


@pytest.fixture(scope="module")
def reference(smollm2_path) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, run alone in this process with every layer resident."""
    engine = build_local_engine(str(smollm2_path))
    out = {}
    for p in PROMPTS:
        ids = engine.prompt_tokens(prompt=p, raw=True)
        engine.submit(EngineRequest(id=p, prompt_tokens=ids, params=SamplingParams(temperature=0.0, max_tokens=N_TOKENS)))
        while engine.has_work:
            for ev in engine.step():
                if ev["type"] == "done":
                    out[p] = ev["tokens"]
    return out


@pytest.fixture(scope="module")
def storage_pipeline(smollm2_path, run_dir):
    """Every layer on the storage tier: each pass streams all 30 layers through both rings."""
    with running_pipeline(str(smollm2_path), run_dir, "--gpu-layers", "0", "--ram-budget", "0", name="storage") as p:
        yield p


@pytest.mark.slow
def test_storage_tier_equals_reference_and_status_names_bottleneck(storage_pipeline, reference):
    st = storage_pipeline.status()
    assert st["plan"]["tiers"] == ["storage"] * 30
    for prompt in PROMPTS[:2]:
        done = storage_pipeline.generate_greedy(prompt, N_TOKENS)
        assert done["tokens"] == reference[prompt], prompt
    st = storage_pipeline.wait_stages_moved_bytes()
    # compute reports its token count with its clocks, every stats interval: wait for the last ones
    st = storage_pipeline.wait_status(lambda s: s["tokens_generated"] >= 2 * N_TOKENS, "both requests' tokens counted")
    assert st["bottleneck"] in ("reader", "dma", "compute")
    # the default model lives under ~/.cache on a real file system: the reader uses O_DIRECT there
    # (the fallback for file systems that refuse it is exercised in tests/test_reader_io.py)
    assert st["io"]["io_mode"] == "direct", st["io"]
    # the human view renders without error and names the bottleneck; in an 80-column terminal
    # every stage figure stays whole (rich cuts cells that do not fit with "…")
    r = ntxctl("status", "--name", "storage", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "bottleneck" in r.stdout and "reader" in r.stdout and "compute" in r.stdout
    rows = [ln for ln in r.stdout.splitlines() if ln.strip().startswith(("stage", "reader", "dma", "compute"))]
    assert len(rows) >= 4 and not any("…" in ln for ln in rows), r.stdout


def test_eight_concurrent_clients(storage_pipeline, reference):
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def one(prompt: str) -> None:
        try:
            with Client(storage_pipeline.listen, event_timeout_s=300) as c:
                toks = []
                for ev in c.generate(prompt, raw=True, temperature=0.0, max_tokens=N_TOKENS):
                    if ev["type"] == "token":
                        toks.append(ev["token"])
                    else:
                        assert ev["tokens"] == toks
                results[prompt] = toks
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert results == {p: reference[p] for p in PROMPTS}


def test_bad_input_on_the_wire_keeps_serving(storage_pipeline, smollm2_path):
    with storage_pipeline.client() as c:
        # a well-behaved request, long enough to stay in flight while the bad ones arrive
        good = c.submit("The capital of France is", raw=True, temperature=0.0, max_tokens=400)
        c.send_raw(b"\xc1\xff not msgpack")
        assert "msgpack" in c.next_event(None, 30)["message"]
        c.send_raw(msgpack.packb([1, 2, 3]))
        assert "map" in c.next_event(None, 30)["message"]
        cases = [
            ({"op": "fly", "id": "a"}, "unknown op"),
            ({"op": "generate", "id": "b", "prompt": 5}, "'prompt'"),
            ({"op": "generate", "id": "c", "prompt": ""}, "empty prompt"),
            ({"op": "generate", "id": "d", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
            ({"op": "generate", "id": "e", "prompt": "hi", "temperature": -3.0}, "temperature"),
            ({"op": "generate", "id": "f", "prompt": "hi", "top_p": 9.0}, "top_p"),
            ({"op": "generate", "id": "g", "prompt": "x " * 9000, "raw": True}, "context"),  # past 8192
            ({"op": "generate", "id": "h", "tokens": [1, 2, 10**9]}, "vocabulary"),
            ({"op": "generate", "id": "i", "prompt": "hi", "stop": "x"}, "'stop'"),
        ]
        for msg, needle in cases:
            c.send(msg)
            ev = c.next_event(msg["id"], 60)
            assert ev["type"] == "error", (msg, ev)
            assert needle in ev["message"], (needle, ev)
        first = c.next_event(good, 120)  # the good request is served meanwhile
        assert first["type"] == "token" and first["text"] == " Paris"
        # the same id again while it is in flight: an error reply under that id, between its tokens
        c.send({"op": "generate", "id": good, "prompt": "again"})
        text = first["text"]
        while True:
            ev = c.next_event(good, 120)
            assert ev["type"] != "done", "the long request ended before the duplicate was refused"
            if ev["type"] == "error":
                assert "already in flight" in ev["message"], ev
                break
            text += ev["text"]
        c.cancel(good)
        while ev["type"] != "done":
            ev = c.next_event(good, 120)
            text += ev.get("text", "") if ev["type"] == "token" else ""
        assert ev["finish_reason"] == "cancelled"
        assert "Paris" in ev["text"]


def test_cancel_tells_the_client(storage_pipeline):
    with storage_pipeline.client() as c:
        rid = c.submit("Once upon a time", raw=True, temperature=0.0, max_tokens=500)
        first = c.next_event(rid, 120)
        assert first["type"] == "token"
        c.cancel(rid)
        done = None
        for ev in c.events(rid):
            done = ev
        assert done["finish_reason"] == "cancelled"


@pytest.mark.slow
@pytest.mark.parametrize("daemon", ["compute", "dma", "reader"])
def test_kill_9_each_daemon_restarts_pipeline(storage_pipeline, daemon):
    st = storage_pipeline.wait_state("ready")
    gen = st["gen"]
    pid = st["daemons"][daemon]["pid"]
    with storage_pipeline.client() as c:
        rid = c.submit("Once upon a time", raw=True, temperature=0.0, max_tokens=500)
        assert c.next_event(rid, 120)["type"] == "token"  # it is generating
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ClientError) as err:
            for _ in c.events(rid):
                pass
        assert err.value.code == "pipeline_failure"
        assert daemon in str(err.value) and "SIGKILL" in str(err.value)
    st = storage_pipeline.wait_state("ready", min_gen=gen + 1)
    assert st["restarts"] >= 1
    assert st["daemons"][daemon]["pid"] != pid
    done = storage_pipeline.generate_greedy("The capital of France is", 2)  # " Paris" comes first
    assert "Paris" in done["text"]
    # the old generation's shared memory is gone; only the new generation's remains
    left = [x for x in instance.leftovers("storage") if x.startswith("shm:")]
    assert left and all(f"-g{st['gen']}-" in x for x in left), left


@pytest.mark.slow
@pytest.mark.parametrize("slots", [2, 3])
def test_mixed_plan_equals_reference(smollm2_path, run_dir, reference, slots):
    # 10 resident layers, about 12 in pinned RAM, the rest from storage
    with running_pipeline(str(smollm2_path), run_dir, "--gpu-layers", "10", "--ram-budget", "30MiB",
                          "--slots", str(slots), name=f"mixed{slots}") as p:
        st = p.status()
        tiers = st["plan"]["tiers"]
        assert {"vram", "ram", "storage"} <= set(tiers), tiers
        assert st["plan"]["n_slots"] == slots
        for prompt in PROMPTS[2:4]:
            assert p.generate_greedy(prompt, N_TOKENS)["tokens"] == reference[prompt]
        # dma counts what it copied by the tier it came from, in the same report as its total
        wait_for(lambda: all(_dma(p).get("tier_bytes", {}).get(t, 0) > 0 for t in ("ram", "storage")), 15.0,
                 lambda: f"dma's report to count both tiers (now {_dma(p).get('tier_bytes')})")
        dma = _dma(p)
        assert sum(dma["tier_bytes"].values()) == dma["total"]["bytes"], dma


def _dma(p) -> dict:
    return p.status()["stages"].get("dma", {})


def test_stop_leaves_nothing_and_start_errors_are_one_line(smollm2_path, run_dir, tmp_path):
    listen = f"tcp://127.0.0.1:{free_port()}"
    r = ntxctl("start", "--model", str(smollm2_path), "--name", "leak", "--backend", "cpu", "--listen", listen,
               "--gpu-layers", "5", "--ram-budget", "20MiB")
    assert r.returncode == 0, r.stderr
    assert instance.leftovers("leak"), "a running instance has segments and sockets"
    # a second start of the same name is refused in one line
    r2 = ntxctl("start", "--model", str(smollm2_path), "--name", "leak", "--backend", "cpu", "--listen", listen)
    assert r2.returncode != 0 and "already running" in r2.stderr and "Traceback" not in r2.stderr
    r = ntxctl("stop", "--name", "leak")
    assert r.returncode == 0, r.stderr
    assert instance.leftovers("leak") == []
    assert not (run_dir / "leak").exists()
    # stop of a stopped instance says so
    r = ntxctl("stop", "--name", "leak")
    assert r.returncode != 0 and "not running" in r.stderr
    # a bad model file fails start with the file's own problem, nothing started
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    r = ntxctl("start", "--model", str(bad), "--name", "bad", "--backend", "cpu", "--listen", listen)
    assert r.returncode != 0
    assert "not a GGUF file" in r.stderr and "Traceback" not in r.stderr
    assert instance.leftovers("bad") == []
    # --plan-only prints the plan and starts nothing
    r = ntxctl("start", "--model", str(smollm2_path), *own_instance("plan"), "--backend", "cpu", "--plan-only",
               "--gpu-layers", "3", "--ram-budget", "0")
    assert r.returncode == 0 and "storage" in r.stdout and "compute memory" in r.stdout
    assert instance.leftovers("plan") == [] and not (run_dir / "plan").exists()


def test_status_and_generate_without_pipeline_say_how_to_start(run_dir):
    r = ntxctl("status", "--name", "nothing-here")
    assert r.returncode != 0 and "ntxctl start" in r.stderr
    r = ntxctl("chat", "--listen", f"tcp://127.0.0.1:{free_port()}")
    assert r.returncode != 0 and "ntxctl start" in r.stderr


@pytest.mark.slow
def test_ram_tier_without_storage_layers(smollm2_path, run_dir, reference):
    """No storage layer, so no reader daemon: the dma daemon must not wait on a reader."""
    with running_pipeline(str(smollm2_path), run_dir, "--gpu-layers", "20", "--ram-budget", "1GiB", name="ramonly") as p:
        st = p.status()
        assert "storage" not in st["plan"]["tiers"] and "ram" in st["plan"]["tiers"]
        assert "reader" not in st["daemons"]
        assert p.generate_greedy(PROMPTS[4], N_TOKENS)["tokens"] == reference[PROMPTS[4]]
        wait_for(lambda: _dma(p).get("tier_bytes", {}).get("ram", 0) > 0, 15.0, "dma's report to count the RAM tier")
        assert _dma(p)["tier_bytes"]["storage"] == 0


@pytest.mark.slow
def test_gives_up_after_bounded_restarts_and_status_says_why(smollm2_path, run_dir):
    listen = f"tcp://127.0.0.1:{free_port()}"
    r = ntxctl("start", "--model", str(smollm2_path), "--name", "flaky", "--backend", "cpu", "--listen", listen,
               "--gpu-layers", "5", "--ram-budget", "0", "--max-restarts", "1")
    assert r.returncode == 0, r.stderr
    p = Pipeline("flaky", listen, run_dir)
    os.kill(p.status()["daemons"]["compute"]["pid"], signal.SIGKILL)
    st = p.wait_state("ready", min_gen=1)
    os.kill(st["daemons"]["compute"]["pid"], signal.SIGKILL)
    wait_for(lambda: instance.get_status("flaky", 1.0) is None, 60, "the supervisor to give up")
    wait_for(lambda: instance.leftovers("flaky") == [], 30, lambda: f"no leftovers: {instance.leftovers('flaky')}")
    r = ntxctl("status", "--name", "flaky")
    assert r.returncode != 0
    assert "gave up after 1 restarts" in r.stderr and "compute daemon" in r.stderr and "SIGKILL" in r.stderr


@pytest.mark.slow
def test_chat_keeps_the_conversation_and_status_watch_renders(storage_pipeline):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "ntx.ctl.cli", "chat", "--listen", storage_pipeline.listen, "--temperature", "0",
         "--max-tokens", "6"],
        input="What is the capital of France?\nAnd of Italy?\n/exit\n", capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    turns = [t for t in r.stdout.split("> ") if t.strip()]
    assert len(turns) == 2 and all(t.strip() for t in turns), r.stdout
    # --watch redraws until interrupted. On a terminal (a pty here) it draws at once; interrupted
    # once it has drawn the table twice (so it is inside its refresh loop), it ends cleanly.
    screen, terminal = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "ntx.ctl.cli", "status", "--name", "storage", "--watch"],
                         stdout=terminal, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TERM": "xterm", "COLUMNS": "120"})
    os.close(terminal)
    drawn = bytearray()

    def read_screen() -> None:
        """Take what it drew so far (kept read, so its writes never block on a full pty)."""
        try:
            while select.select([screen], [], [], 0)[0]:
                drawn.extend(os.read(screen, 1 << 16))
        except OSError:  # EIO: the program has closed its terminal
            pass

    def table_drawn_twice() -> bool:
        read_screen()
        assert p.poll() is None, f"status --watch ended by itself: {p.stderr.read()}"
        return drawn.count(b"stages") >= 2

    def ended() -> bool:
        read_screen()
        return p.poll() is not None

    try:
        wait_for(table_drawn_twice, 60, lambda: f"status --watch to draw its table twice; drew {bytes(drawn)!r}")
        p.send_signal(signal.SIGINT)
        wait_for(ended, 30, "status --watch to end on Ctrl-C")
        err = p.stderr.read()
    finally:
        p.kill()  # only if it is still running (a failed wait above)
        p.wait(timeout=30)
        os.close(screen)
    assert p.returncode == 0 and "Traceback" not in err, err


def test_start_fails_with_the_pipelines_own_reason(smollm2_path, run_dir):
    """A daemon that is not ready in time: start says which one and why, in one line, and nothing
    of the instance is left behind."""
    r = ntxctl("start", "--model", str(smollm2_path), "--name", "slow", "--backend", "cpu",
               "--listen", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.2")
    assert r.returncode != 0
    assert "compute daemon was not ready within" in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("ntxctl: error:")]) == 1
    wait_for(lambda: instance.leftovers("slow") == [], 30, lambda: f"no leftovers: {instance.leftovers('slow')}")


def test_backend_cuda_without_gpu_names_the_fix(smollm2_path, run_dir):
    from ntx.daemons.compute.cuda_check import cuda_problem

    if cuda_problem() is None:
        pytest.skip("this machine has a usable GPU")
    r = ntxctl("start", "--model", str(smollm2_path), "--name", "nogpu", "--backend", "cuda",
               "--listen", f"tcp://127.0.0.1:{free_port()}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--backend cuda cannot run" in r.stderr and "--backend cpu" in r.stderr
    # without cupy the line names the install; with cupy but no usable driver, the driver
    assert "pip install 'ntransformer[cuda12]'" in r.stderr or "driver" in r.stderr
    assert instance.leftovers("nogpu") == []


def test_a_qwen2_model_streams_through_the_daemons_as_it_runs_in_process(run_dir, tmp_path):
    """A Qwen2-shaped model (q, k, v biases in every layer's image; halves rotated) through the
    reader and dma daemons, one layer resident and three from storage: the greedy tokens of an
    in-process run with every layer resident."""
    from .synth_models import write_tiny

    model = str(write_tiny(tmp_path, "qwen2.gguf", n_layers=4, arch="qwen2", type="Q4_K_M", seed=5))
    engine = build_local_engine(model)
    text = "The history of the transistor begins"
    engine.submit(EngineRequest(id="q", prompt_tokens=engine.prompt_tokens(prompt=text, raw=True),
                                params=SamplingParams(temperature=0.0, max_tokens=8)))
    want = None
    while engine.has_work:
        for ev in engine.step():
            if ev["type"] == "done":
                want = ev["tokens"]
    with running_pipeline(model, run_dir, "--gpu-layers", "1", "--ram-budget", "0", name="qwen2") as p:
        tiers = p.status()["plan"]["tiers"]
        assert sorted(tiers) == ["storage"] * 3 + ["vram"], tiers
        assert p.generate_greedy(text, 8)["tokens"] == want
