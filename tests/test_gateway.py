"""The HTTP gateway against a real pipeline on the CPU backend (``ntxctl start --http``).

The official ``openai`` package is the client for what works (streaming and not), raw HTTP for
the error cases (OpenAI's error schema), /metrics is read with prometheus_client's own parser,
and a client that hangs up must see its request cancelled in the pipeline within a second.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .pipeline_util import free_port, ntxctl, running_pipeline, wait_for

FRANCE = "The capital of France is"
HI = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a very long story."}]


@pytest.fixture(scope="module")
def served(smollm2_path, run_dir):
    """A pipeline with its gateway on a free port: 26 layers resident and 4 read from storage,
    so that every stage (reader, dma, compute) works and shows."""
    http = f"127.0.0.1:{free_port()}"
    with running_pipeline(str(smollm2_path), run_dir, "--gpu-layers", "26", "--ram-budget", "0", "--http", http,
                          name="gw") as p:
        p.http = http
        p.base = f"http://{http}"
        yield p


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=120)


def _in_flight(pipeline) -> int:
    return pipeline.status()["requests"]["in_flight"]


def test_chat_equals_the_pipeline_and_streams_the_same(served, oai):
    with served.client() as c:
        want = c.complete(messages=HI, temperature=0.0, max_tokens=5)
    r = oai.chat.completions.create(model="any", messages=HI, temperature=0, max_tokens=5)
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want["finish_reason"] == "length"
    assert r.usage.prompt_tokens == len(want["prompt_tokens"]) and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.model == os.path.basename(served.status()["model"])

    chunks = list(oai.chat.completions.create(model="any", messages=HI, temperature=0, max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 5  # usage in the last chunk

    # stream_options.include_usage: OpenAI's own shape, a last chunk with no choices
    chunks = list(oai.chat.completions.create(model="any", messages=HI, temperature=0, max_tokens=4, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_raw_text_and_token_ids(served, oai):
    r = oai.completions.create(model="any", prompt=FRANCE, temperature=0, max_tokens=6, seed=1)
    assert r.choices[0].text.startswith(" Paris")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6
    streamed = list(oai.completions.create(model="any", prompt=FRANCE, temperature=0, max_tokens=6, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    by_ids = oai.completions.create(model="any", prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == r.choices[0].text


def test_sampling_fields_are_mapped(served, oai):
    """stop ends the text before the stop string; a seed repeats a sampled answer."""
    r = oai.completions.create(model="any", prompt=FRANCE, temperature=0, max_tokens=12, stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text
    a, b = (oai.chat.completions.create(model="any", messages=HI, temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_logprobs(served, oai):
    r = oai.chat.completions.create(model="any", messages=HI, temperature=0, max_tokens=5, logprobs=True,
                                    top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 5
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.token == e.top_logprobs[0].token  # greedy: the chosen token is the best
    assert "".join(e.token for e in entries) == r.choices[0].message.content

    c = oai.completions.create(model="any", prompt=FRANCE, temperature=0, max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp.tokens[0] == " Paris" and len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0


def test_models_and_health(served, oai):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [os.path.basename(served.status()["model"])]
    r = httpx.get(f"{served.base}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": "m"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": HI, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": HI, "top_p": 7}, 400, None),  # the pipeline's own check
    ("/v1/completions", {"prompt": {"x": 1}}, 400, "prompt"),
    ("/v1/completions", {"prompt": FRANCE, "logprobs": 99}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": HI, "speculative": "yes"}, 400, "speculative"),
])
def test_bad_requests_answer_in_openai_error_schema(served, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{served.base}{path}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    if path.endswith("chat/completions") and isinstance(body, dict) and "top_p" in body:
        assert "top_p" in err["message"]


def test_context_overflow_and_unknown_routes(served, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="any", prompt=[1] * 9000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    r = httpx.get(f"{served.base}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{served.base}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def _metric_families(served) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{served.base}/metrics").text)}


def _streamed_by_tier(families: dict) -> dict[str, float]:
    return {s.labels["tier"]: s.value for s in families["ntx_streamed_bytes"].samples if s.name.endswith("_total")}


def test_metrics_parse_and_count(served, oai):
    oai.chat.completions.create(model="any", messages=HI, temperature=0, max_tokens=3)
    # the daemons report their counters every status interval: wait for the request's passes
    wait_for(lambda: _streamed_by_tier(_metric_families(served))["storage"] > 0, 15.0, "dma's storage bytes in /metrics")
    families = _metric_families(served)
    requests = {tuple(sorted(s.labels.items())): s.value for s in families["ntx_http_requests"].samples
                if s.name == "ntx_http_requests_total"}
    assert requests[(("endpoint", "chat"), ("finish", "length"))] >= 1
    ttft = {s.name: s.value for s in families["ntx_time_to_first_token_seconds"].samples if not s.labels.get("le")}
    assert ttft["ntx_time_to_first_token_seconds_count"] >= 1 and ttft["ntx_time_to_first_token_seconds_sum"] > 0
    per_token = {s.name: s.value for s in families["ntx_time_per_output_token_seconds"].samples}
    assert per_token["ntx_time_per_output_token_seconds_count"] >= 2
    assert [s.value for s in families["ntx_pipeline_ready"].samples] == [1.0]
    shares = {(s.labels["stage"], s.labels["state"]) for s in families["ntx_stage_share"].samples}
    assert ("compute", "busy") in shares and ("compute", "starved") in shares
    tiers = _streamed_by_tier(families)
    assert tiers["storage"] > 0 and tiers["ram"] == 0, tiers  # 4 layers on storage, none in pinned RAM
    generated = [s.value for s in families["ntx_generated_tokens"].samples if s.name == "ntx_generated_tokens_total"]
    assert generated[0] >= 3


def test_speculation_metrics_come_from_the_pipelines_status():
    """With a drafter, status' speculation counts become counters and the rate a gauge (the
    collector alone: the pipeline above has no drafter)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from ntx.ctl.gateway.metrics import PipelineCollector

    spec = dict(drafter="ngram", drafted=40, accepted=10, acceptance_rate=0.25, trees_cut=3)
    registry = CollectorRegistry()
    registry.register(PipelineCollector(lambda: {"state": "ready", "speculation": spec}))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    got = {f: [s.value for s in families[f].samples] for f in
           ("ntx_speculation_drafted_tokens", "ntx_speculation_accepted_tokens", "ntx_speculation_acceptance_rate",
            "ntx_speculation_trees_cut")}
    assert got == {"ntx_speculation_drafted_tokens": [40.0], "ntx_speculation_accepted_tokens": [10.0],
                   "ntx_speculation_acceptance_rate": [0.25], "ntx_speculation_trees_cut": [3.0]}


QUOTE = [{"role": "user", "content": "Repeat this sentence exactly, word for word: The old lighthouse keeper "
                                    "climbed the one hundred and twelve stairs every evening to light the lamp."}]


def test_speculative_per_request_and_what_it_gave(smollm2_path, tmp_path):
    """With a drafter (``--draft ngram``), a request's ``speculative`` reaches the pipeline as
    on the wire: false gives the same text without a verify pass, and a drafted request's
    response (the last chunk when streamed) carries ``ntx.speculation``, the ``done`` reply's
    counts; anything but a boolean is a 400 naming the field. 20 of the 30 layers stream, so a
    verify pass costs about a plain one's time and the prompt lookup drafts the quote."""
    http = f"127.0.0.1:{free_port()}"
    with running_pipeline(str(smollm2_path), tmp_path, "--gpu-layers", "10", "--draft", "ngram", "--draft-tokens",
                          "8", "--ctx", "512", "--http", http, name="gwspec"):
        oai = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(**kw):
            r = oai.chat.completions.create(model="any", messages=QUOTE, temperature=0, max_tokens=40, **kw)
            return r.choices[0].message.content, (r.model_extra or {})["ntx"]

        plain_text, plain = ask(extra_body={"speculative": False})
        text, spec = ask()
        assert text == plain_text and "lighthouse keeper climbed" in text
        assert "speculation" not in plain
        counts = spec["speculation"]
        assert counts["verify_passes"] >= 1 and 0 < counts["accepted"] <= counts["drafted"], counts
        assert counts["accepted_per_pass"] == round(counts["accepted"] / counts["verify_passes"], 3)
        text, spec = ask(extra_body={"speculative": True})
        assert text == plain_text and spec["speculation"]["verify_passes"] >= 1

        chunks = list(oai.chat.completions.create(model="any", messages=QUOTE, temperature=0, max_tokens=40,
                                                  stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain_text
        assert chunks[-1].model_extra["ntx"]["speculation"]["verify_passes"] >= 1

        r = httpx.post(f"http://{http}/v1/chat/completions", json={"messages": QUOTE, "speculative": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text


def _gateway_in_flight(served) -> int:
    return httpx.get(f"{served.base}/api/status").json()["gateway"]["in_flight"]


def test_a_body_over_the_frame_bound_is_413_and_other_users_go_on(served, oai):
    """A 17 MiB body (over libzmq's 16 MiB frame bound, which dropped the gateway's one
    connection and every user's request with it) is 413 before it is read, while another
    user's stream runs to its end; out-of-range numbers are 400 and leave no entry behind."""
    from ntx.ctl.gateway.limits import MAX_BODY_BYTES
    from ntx.shared.messages import MAX_FRAME_BYTES

    streamed: list = []
    # a story, not HI: the answer to HI ends after a few tokens, and on a loaded CI machine it
    # once came and went between two status polls (the wait below then timed out)
    t = threading.Thread(target=lambda: streamed.extend(oai.chat.completions.create(
        model="m", messages=STORY, temperature=0, max_tokens=120, stream=True)))
    t.start()
    wait_for(lambda: _in_flight(served) == 1 or not t.is_alive(), 30.0, "the other user's request to run")
    host, port = served.http.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (17 << 20) + b'{"messages": [{"role": "user", "content": "' + b"x" * (1 << 20))
        s.settimeout(10.0)
        answer = b""
        while b"request_too_large" not in answer:
            answer += s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    r = httpx.post(f"{served.base}/v1/completions", json={"prompt": "x" * (MAX_BODY_BYTES + 1)})
    assert r.status_code == 413
    # a body under the gateway's bound whose frame is over the supervisor's: 413 too, never sent
    r = httpx.post(f"{served.base}/v1/completions", json={"prompt": "x" * (MAX_FRAME_BYTES + 1000)})
    assert r.status_code == 413, r.text
    for _ in range(50):
        r = httpx.post(f"{served.base}/v1/completions", json={"prompt": FRANCE, "seed": 2 ** 70})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    for opts in ("yes", [1], 3):
        r = httpx.post(f"{served.base}/v1/chat/completions", json={"messages": HI, "stream": True, "stream_options": opts})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    t.join(60.0)
    # the other user's stream ran to its own end
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    assert streamed[-1].model_extra["ntx"]["finish_reason"] in ("stop", "length")
    wait_for(lambda: _in_flight(served) == 0 and _gateway_in_flight(served) == 0, 10.0,
             "no request entry left behind, at the pipeline or the gateway")


def test_streaming_client_that_hangs_up_is_cancelled_within_a_second(served):
    # greedy: the model's greedy story runs past 400 tokens, where a sampled one (temperature 0.8)
    # once ended before the status was read, and the pipeline rightly said nothing ran: CI failed
    body = {"messages": STORY, "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{served.base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while '"content":""' in next(l for l in lines if l.startswith("data:")):
                pass  # the role chunk; then the first token arrived: the request runs
            assert _in_flight(served) == 1
        hung_up_s = time.monotonic()  # leaving the block closed the connection
    wait_for(lambda: _in_flight(served) == 0, 1.0,
             lambda: f"the pipeline to drop the request after the hang-up (now: {served.status()['requests']})")
    assert time.monotonic() - hung_up_s < 1.0


def test_non_streaming_client_that_times_out_is_cancelled_within_a_second(served):
    # counting never meets an end of text (a story could end within the 1.5 s on the CPU kernels)
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 3000, "temperature": 0}
    wait_for(lambda: _in_flight(served) == 0, 10.0, "no request in flight before the test")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base}/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=1.5))
    hung_up_s = time.monotonic()
    wait_for(lambda: _in_flight(served) == 0, 1.0,
             lambda: f"the pipeline to drop the request after the time-out (now: {served.status()['requests']})")
    assert time.monotonic() - hung_up_s < 1.0


@pytest.fixture(scope="module")
def keyed_gateway(served, tmp_path_factory):
    """A second gateway on the same pipeline that needs a key, run as ``python -m ntx.ctl.gateway``
    with the key in a file (mode 0600, which it deletes once read)."""
    http = f"127.0.0.1:{free_port()}"
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text("s3cret\n")
    key_file.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.gateway", "--pipeline", served.listen, "--http", http,
                             "--api-key-file", str(key_file)],
                            env={k: v for k, v in os.environ.items() if k != "NTX_API_KEY"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://{http}"

    def answers() -> bool:
        try:
            return httpx.get(f"{base}/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answers, 30.0, "the keyed gateway to answer /health")
        assert not key_file.exists()  # read once and deleted
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_api_key_is_required_when_set(keyed_gateway):
    r = httpx.get(f"{keyed_gateway}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_gateway}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{keyed_gateway}/metrics").status_code == 401
    for header in ("bearer s3cret", "BEARER  s3cret"):  # the scheme is case-insensitive
        assert httpx.get(f"{keyed_gateway}/v1/models", headers={"Authorization": header}).status_code == 200, header
    assert httpx.get(f"{keyed_gateway}/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
    ok = openai.OpenAI(base_url=f"{keyed_gateway}/v1", api_key="s3cret", max_retries=0)
    assert ok.chat.completions.create(model="m", messages=HI, temperature=0, max_tokens=2).usage.completion_tokens == 2


def test_gateway_without_a_pipeline_says_503(tmp_path):
    """/health is 503 and requests get a 503 error while no pipeline answers."""
    http = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "ntx.ctl.gateway", "--pipeline", f"tcp://127.0.0.1:{free_port()}",
                             "--http", http], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://{http}"

    def health():
        try:
            return httpx.get(f"{base}/health")
        except httpx.HTTPError:
            return None

    try:
        r = wait_for(health, 30.0, "the gateway to answer")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": HI})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_http_beyond_loopback_needs_a_key(smollm2_path):
    r = ntxctl("start", "--model", str(smollm2_path), "--name", "exposed", "--backend", "cpu",
               "--listen", f"tcp://127.0.0.1:{free_port()}", "--http", f"0.0.0.0:{free_port()}",
               env={"NTX_API_KEY": ""})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("ntxctl: error: --http on 0.0.0.0 listens beyond this machine")


def _headless_chromium():
    """Debian's chromium through its own chromedriver (.ci/run installs both); skip, saying
    what is missing, only where they are not installed."""
    driver = shutil.which("chromedriver")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if not driver or not binary:
        pytest.skip("the status page's browser test needs chromium and chromedriver "
                    "(Debian: apt-get install chromium chromium-driver, which .ci/run does as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


# Where the status page's layout breaks, as a list of sentences (empty: it fits): the page wider
# than the window, an element out of the window or out of the panel it belongs to, or one whose
# content (a line of text that does not wrap) is wider than the element.
LAYOUT_FAULTS_JS = """
const vw = window.innerWidth, doc = document.documentElement, faults = [];
const name = e => `${e.tagName.toLowerCase()}${e.id ? "#" + e.id : ""} "${(e.textContent || "").trim().slice(0, 30)}"`;
if (doc.scrollWidth > vw) faults.push(`the page is ${doc.scrollWidth} px wide in a ${vw} px window`);
for (const e of document.body.querySelectorAll("*")) {
  const r = e.getBoundingClientRect();
  if (r.width && (r.left < -0.5 || r.right > vw + 0.5)) faults.push(`${name(e)} spans ${r.left}-${r.right} px of ${vw}`);
}
for (const panel of document.querySelectorAll(".panel")) {
  const p = panel.getBoundingClientRect();
  for (const e of panel.querySelectorAll("*")) {
    const r = e.getBoundingClientRect();
    if (r.width && (r.left < p.left - 0.5 || r.right > p.right + 0.5))
      faults.push(`${name(e)} spans ${r.left}-${r.right} px, out of its panel (${p.left}-${p.right} px)`);
    if (!(e instanceof SVGElement) && e.clientWidth && e.scrollWidth > e.clientWidth + 1)
      faults.push(`${name(e)} holds ${e.scrollWidth} px of content in ${e.clientWidth} px`);
  }
}
return faults;
"""


def _window(browser, width_px: int, height_px: int = 900) -> None:
    """The page as a window ``width_px`` wide shows it (a phone's below 600 px: touch, its viewport)."""
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width_px, "height": height_px, "deviceScaleFactor": 1, "mobile": width_px < 600})


def _check_layout(browser, width_px: int, shot) -> None:
    """At ``width_px``: after two redraws, nothing sticks out of the window or of its panel, the
    charts take most of the width, and a screenshot of the whole page is left at ``shot``."""
    from selenium.webdriver.common.by import By

    _window(browser, width_px)
    samples = int(browser.find_element(By.ID, "samples").text)
    wait_for(lambda: int(browser.find_element(By.ID, "samples").text) >= samples + 2, 30.0,
             f"the page to redraw at {width_px} px")
    assert browser.execute_script("return window.innerWidth") == width_px
    assert browser.execute_script(LAYOUT_FAULTS_JS) == [], f"at {width_px} px"
    for svg in browser.find_elements(By.CSS_SELECTOR, "svg.chart"):
        assert svg.rect["width"] >= 0.8 * min(width_px, 1100), f"a chart {svg.rect['width']} px wide at {width_px} px"
    _window(browser, width_px, browser.execute_script("return document.documentElement.scrollHeight"))
    browser.save_screenshot(str(shot))
    _window(browser, width_px)


def test_status_page_in_a_headless_browser(served, tmp_path):
    """The page shows every stage with a chart on a time axis with units, the processes with
    their pids, the plan with the cpu backend's tier names (no "vram": it has none) and says
    idle while nothing runs; while a request runs it lists it with its tokens, and it updates.
    At a desktop's 1280 px and a phone's 390 px, idle and busy, nothing sticks out of the window
    or its panel (screenshots of each are left in the test's folder, ``status-WIDTH-STATE.png``)."""
    from selenium.webdriver.common.by import By

    def text(element_id: str) -> str:
        return browser.find_element(By.ID, element_id).text

    # tables and charts are drawn anew each second: their texts are read in one script
    def texts(css: str) -> list[str]:
        return browser.execute_script("return Array.from(document.querySelectorAll(arguments[0]), e => e.textContent)",
                                      css)

    def rows(table_id: str) -> list[list[str]]:
        return browser.execute_script("return Array.from(document.querySelectorAll(`#${arguments[0]} tbody tr`), "
                                      "tr => Array.from(tr.cells, td => td.textContent))", table_id)

    def figure(element_id: str) -> int:
        return int(text(element_id))

    def request_rows() -> list[list[str]]:
        return rows("requests")

    browser = _headless_chromium()
    try:
        _window(browser, 1280)
        browser.get(f"{served.base}/")
        for stage in ("reader", "dma", "compute"):
            wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, f'.stage[data-stage="{stage}"]'), 30.0,
                     f"the page to show the {stage} stage")
        assert text("state") == "ready"
        wait_for(lambda: text("bottleneck") == "idle", 30.0, lambda: f"idle, not {text('bottleneck')!r}")
        assert not browser.find_elements(By.CSS_SELECTOR, ".stage.bottleneck") and not request_rows()
        assert text("requests-none") == "none: idle"

        # the plan: the resident tier is compute's memory on the cpu backend
        assert [row[0] for row in rows("tiers")] == ["compute memory", "pinned RAM", "storage"]
        assert "storage" in text("plan") and "vram" not in text("plan").lower()
        # processes: the supervisor and each daemon with its pid, as status says
        st = served.status()
        procs = {row[0]: row for row in rows("daemons")}
        assert procs["supervisor"][1] == str(st["supervisor_pid"])
        for name in ("compute", "dma", "reader"):
            assert procs[name][1] == str(st["daemons"][name]["pid"]) and procs[name][2] == "ready"
            assert procs[name][4] == str(st["restarts"]) and procs[name][3].endswith((" s", " min", " h"))
        assert procs["http gateway"][1].isdigit()
        # charts: a time axis in seconds before now, y axes with their units
        x_ticks = texts('[data-chart="tok-s"] .x-tick')
        assert x_ticks[0] == "\u221260 s" and x_ticks[-1] == "now" and all(t.endswith(" s") for t in x_ticks[:-1])
        assert texts('[data-chart="tok-s"] .y-unit') == ["tok/s"]
        for stage in ("reader", "dma", "compute"):
            assert texts(f'.stage[data-stage="{stage}"] .y-tick') == ["0%", "50%", "100%"]
            assert texts(f'.stage[data-stage="{stage}"] .y-unit') == ["% time"]
        for width in (1280, 390):
            _check_layout(browser, width, tmp_path / f"status-{width}-idle.png")

        before = figure("tokens-generated")
        # greedy counting never meets an end of text (a "very long story" once ended before the page
        # was read, and the page rightly said idle)
        body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{served.base}/v1/completions", json=body):
            wait_for(lambda: figure("in-flight") == 1 and figure("tokens-generated") > before, 30.0,
                     "the page to show the running request and its tokens")
            seen = figure("tokens-generated")
            wait_for(lambda: figure("tokens-generated") > seen, 30.0, "the page to update again while it runs")
            assert text("bottleneck") in ("reader", "dma", "compute")
            # the request, by the id status gives it, with its tokens so far out of its max_tokens
            rid = served.status()["requests_in_flight"][0]["id"]
            row = wait_for(lambda: next((r for r in request_rows() if r[0] == rid and r[1] == "decoding"), None),
                           30.0, lambda: f"a decoding row for {rid}, not {request_rows()}")
            generated, max_tokens = row[2].split(" / ")
            assert int(generated) > 0 and max_tokens == "3000" and row[4].endswith(" s")
            # the compute chart has drawn busy time
            busy = browser.execute_script(
                """return document.querySelectorAll('.stage[data-stage="compute"] rect[fill="#2a9d4b"]').length""")
            assert busy > 0
            for width in (1280, 390):
                _check_layout(browser, width, tmp_path / f"status-{width}-busy.png")
        wait_for(lambda: figure("in-flight") == 0 and text("bottleneck") == "idle", 30.0,
                 "the page to show the request gone and the pipeline idle")
        assert not request_rows()
    finally:
        browser.quit()


def test_health_says_loading_while_the_pipeline_starts():
    """/health follows the pipeline's state: 503 "loading" while it starts, 200 once ready (the
    app in process, its status set by hand; nothing listens on its pipeline address)."""
    from starlette.testclient import TestClient

    from ntx.ctl.gateway.app import create_app

    with TestClient(create_app(f"tcp://127.0.0.1:{free_port()}")) as http:
        link = http.app.state.gateway.link
        link.status, link.status_at_s = {"state": "starting"}, time.monotonic()
        r = http.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        link.status, link.status_at_s = {"state": "ready"}, time.monotonic()
        assert http.get("/health").status_code == 200
