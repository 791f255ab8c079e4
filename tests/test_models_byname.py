"""Models by name: `ntxctl pull URL` / hf:// (resume, checks), `ntxctl list`, `ntxctl rm` and
`--model NAME`, against a real HTTP server on loopback that serves synthetic GGUFs and
misbehaves on cue (cuts a body, answers 404 or 503, sends an HTML page, redirects as Hugging
Face does). Every test uses its own NTX_CACHE_DIR."""

from __future__ import annotations

import fcntl
import hashlib
import http.server
import json
import pathlib
import re
import socket
import threading

import pytest

from ntx.ctl import model_pull, model_store, models
from ntx.shared.config import format_bytes
from ntx.shared.errors import NtxError
from ntx.shared.gguf_index import open_model
from tests.synth_models import write_tiny
from tests.test_gguf_index import assert_one_error_line, run_cli_inprocess


class Served:
    """What the loopback server answers, path by path, and what it was asked."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, str, dict[str, str]]] = {}  # path -> body, content type, headers
        self.redirects: dict[str, tuple[str, dict[str, str]]] = {}  # path -> target path, headers
        self.status: dict[str, int] = {}  # path -> an error status to answer
        self.cut_once: dict[str, int] = {}  # path -> bytes of the body sent before the connection drops (once)
        self.down_after_cut = False  # after the cut, the path answers 503
        self.requests: list[tuple[str, str | None, str | None]] = []  # path, Range, Authorization


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        served: Served = self.server.served
        path = self.path.split("?")[0]
        served.requests.append((path, self.headers.get("Range"), self.headers.get("Authorization")))
        if path in served.status:
            self.send_error(served.status[path])
            return
        if path in served.redirects:
            target, headers = served.redirects[path]
            self.send_response(302)
            self.send_header("Location", target)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path not in served.files:
            self.send_error(404)
            return
        body, content_type, headers = served.files[path]
        start = 0
        if self.headers.get("Range"):
            start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) - start))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        cut = served.cut_once.pop(path, None)
        if cut is not None:
            self.wfile.write(body[start:start + cut])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            if served.down_after_cut:
                served.status[path] = 503
            return
        self.wfile.write(body[start:])


@pytest.fixture
def server():
    """A loopback HTTP server on a free port: yields (Served, base URL)."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.served = Served()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.served, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    """A fresh NTX_CACHE_DIR (never the user's) and no pauses between download tries."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("NTX_CACHE_DIR", str(folder))
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(model_pull, "RETRY_DELAYS_S", (0.0, 0.0))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> bytes:
    """A synthetic 2-layer Llama GGUF (~0.9 MB), as bytes."""
    return write_tiny(tmp_path_factory.mktemp("src")).read_bytes()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _model_files(cache: pathlib.Path) -> list[str]:
    folder = cache / "models"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_full_pull_lands_verified_file_and_sidecar(cache, server, tiny):
    served, base = server
    served.files["/m/tiny.gguf"] = (tiny, "application/octet-stream", {"ETag": f'"{_sha(tiny)}"'})
    got = model_pull.pull_model(f"{base}/m/tiny.gguf?download=true", progress=False)
    final = cache / "models" / "tiny.gguf"
    assert got.name == "tiny" and got.paths == (final,) and got.fetched
    assert final.read_bytes() == tiny
    assert got.checked_against == ("ETag",)
    side = json.loads((cache / "models" / "tiny.gguf.json").read_text())
    assert side["sha256"] == _sha(tiny) and side["size"] == len(tiny) and side["checked_against"] == "ETag"
    assert _model_files(cache) == ["tiny.gguf", "tiny.gguf.json"]  # no part, no scratch folder
    assert open_model(got.paths[0]).hparams.n_layers == 2

    # again: present, nothing asked of the server
    asked = len(served.requests)
    again = model_pull.pull_model(f"{base}/m/tiny.gguf", progress=False)
    assert not again.fetched and len(served.requests) == asked


def test_resume_after_a_cut_connection(cache, server, tiny):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    served.cut_once["/tiny.gguf"] = 300_000
    got = model_pull.pull_model(f"{base}/tiny.gguf", sha256=_sha(tiny), progress=False)
    assert got.paths[0].read_bytes() == tiny and got.checked_against == ("--sha256",)
    assert [r[1] for r in served.requests] == [None, "bytes=300000-"]


def test_cut_that_does_not_resume_keeps_the_part_and_the_same_command_resumes(cache, server, tiny):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    served.cut_once["/tiny.gguf"] = 300_000
    served.down_after_cut = True
    with pytest.raises(NtxError, match=f"cut at byte 300000 of {len(tiny)} .*HTTP 503") as e:
        model_pull.pull_model(f"{base}/tiny.gguf", progress=False)
    assert served.requests == [("/tiny.gguf", None, None)] + [("/tiny.gguf", "bytes=300000-", None)] * 2
    assert "the same command resumes it" in str(e.value) and "\n" not in str(e.value)
    part = cache / "models" / ".tiny.gguf.part"
    assert part.stat().st_size == 300_000
    assert not (cache / "models" / "tiny.gguf").exists()

    del served.status["/tiny.gguf"]
    served.requests.clear()
    got = model_pull.pull_model(f"{base}/tiny.gguf", sha256=_sha(tiny), progress=False)
    assert got.paths[0].read_bytes() == tiny
    assert served.requests[0][1] == "bytes=300000-"
    assert not part.exists()


def test_server_that_ignores_range_starts_over(cache, server, tiny):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    (cache / "models").mkdir(parents=True)
    (cache / "models" / ".tiny.gguf.part").write_bytes(b"GGUF" + b"\xff" * 1000)  # not this file's prefix

    real = _Handler.do_GET

    def no_range(self):
        del self.headers["Range"]
        real(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Handler, "do_GET", no_range)
        got = model_pull.pull_model(f"{base}/tiny.gguf", sha256=_sha(tiny), progress=False)
    assert got.paths[0].read_bytes() == tiny


def test_a_whole_part_is_finished_without_a_body(cache, server, tiny):
    """A part that holds the whole file (a run stopped before it landed): the server answers the
    range past its end with 416 and the file's size, and the part lands as it is."""
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    (cache / "models").mkdir(parents=True)
    (cache / "models" / ".tiny.gguf.part").write_bytes(tiny)
    got = model_pull.pull_model(f"{base}/tiny.gguf", sha256=_sha(tiny), progress=False)
    assert got.paths[0].read_bytes() == tiny
    assert served.requests == [("/tiny.gguf", f"bytes={len(tiny)}-", None)]


def test_wrong_checksum_leaves_nothing(cache, server, tiny):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    with pytest.raises(NtxError, match="checksum mismatch for tiny.gguf.*--sha256 says 0000") as e:
        model_pull.pull_model(f"{base}/tiny.gguf", sha256="0" * 64, progress=False)
    assert "\n" not in str(e.value)
    assert _model_files(cache) == []

    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {"ETag": '"' + "ab" * 32 + '"'})
    with pytest.raises(NtxError, match="ETag says abab"):
        model_pull.pull_model(f"{base}/tiny.gguf", progress=False)
    assert _model_files(cache) == []


def test_404_is_one_line(cache, server, monkeypatch, capsys):
    served, base = server
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "pull", f"{base}/nosuch.gguf")
    assert_one_error_line(code, out, err, "HTTP 404", "no file there")
    assert _model_files(cache) == []


def test_html_page_instead_of_a_gguf_is_one_line(cache, server, monkeypatch, capsys):
    served, base = server
    page = b"<!DOCTYPE html><html><body>" + b"x" * 200_000 + b"</body></html>"
    served.files["/o/r/blob/main/m.gguf"] = (page, "text/html; charset=utf-8", {})
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "pull", f"{base}/o/r/blob/main/m.gguf")
    assert_one_error_line(code, out, err, "sent an HTML page, not a GGUF file", "/resolve/, not /blob/")
    assert _model_files(cache) == []


def test_gguf_that_ntx_cannot_load_is_refused(cache, server, tmp_path):
    served, base = server
    data = write_tiny(tmp_path, "mamba.gguf", breakage="bad_arch").read_bytes()
    served.files["/mamba.gguf"] = (data, "application/octet-stream", {})
    with pytest.raises(NtxError, match="a GGUF file, but ntx cannot load it: unsupported architecture.*nothing kept"):
        model_pull.pull_model(f"{base}/mamba.gguf", progress=False)
    assert _model_files(cache) == []


def test_split_set_pulls_every_shard_and_is_one_model(cache, server, tmp_path, monkeypatch, capsys):
    served, base = server
    first = write_tiny(tmp_path, "sp.gguf", split=3)
    for p in sorted(tmp_path.glob("sp-*.gguf")):
        served.files[f"/q/{p.name}"] = (p.read_bytes(), "application/octet-stream", {})
    with pytest.raises(NtxError, match="--sha256 checks one file"):
        model_pull.pull_model(f"{base}/q/sp-00002-of-00003.gguf", sha256="0" * 64, progress=False)
    got = model_pull.pull_model(f"{base}/q/sp-00002-of-00003.gguf", progress=False)
    assert got.name == "sp" and [p.name for p in got.paths] == [f"sp-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for p in got.paths:
        assert p.read_bytes() == (first.parent / p.name).read_bytes()
    assert open_model(got.paths[0]).hparams.n_layers == 2

    code, out, err = run_cli_inprocess(monkeypatch, capsys, "list")
    assert code == 0, err
    rows = out.splitlines()
    assert rows[0].split() == ["NAME", "SIZE", "TYPE", "LAYERS", "PATH"]
    assert len(rows) == 2 and rows[1].split()[0] == "sp" and "(+2 more parts)" in rows[1]
    assert model_store.resolve_model("sp") == str(got.paths[0])

    got.paths[2].unlink()  # a set that lacks a shard: said so, by name
    with pytest.raises(NtxError, match="lacks sp-00003-of-00003.gguf"):
        model_store.resolve_model("sp")


def test_list_rm_and_model_by_name(cache, server, tiny, monkeypatch, capsys):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "list")
    assert code == 0 and "no local models" in out and "ntxctl pull" in out

    code, out, err = run_cli_inprocess(monkeypatch, capsys, "pull", f"{base}/tiny.gguf")
    assert code == 0, err
    assert "tiny pulled" in out and "2 layers" in out and "Q4_K_M, 2 layers; no sha256 offered for the file (recorded only)" in out

    code, out, err = run_cli_inprocess(monkeypatch, capsys, "list")
    assert code == 0, err
    row = re.split(r"\s{2,}", out.splitlines()[1])
    assert row == ["tiny", format_bytes(len(tiny)), "Q4_K_M", "2", str(cache / "models" / "tiny.gguf")]
    # Q4_K_M: general.file_type's name, not only the dominant matrix type (Q4_K)

    for name in ("tiny", "tiny.gguf"):
        assert model_store.resolve_model(name) == str(cache / "models" / "tiny.gguf")
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "inspect", "tiny")
    assert code == 0 and "n_layers         2" in out, err
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "start", "--plan-only", "--backend", "cpu",
                                       "--model", "tiny", "--draft-model", "tiny.gguf")
    assert code == 0 and "2 layers" in out, err

    code, out, err = run_cli_inprocess(monkeypatch, capsys, "generate", "--local", "--model", "nosuch", "hi")
    assert_one_error_line(code, out, err, "--model nosuch: no such file", "local models: tiny", "ntxctl pull URL")
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "start", "--plan-only", "--model", "tiny",
                                       "--draft-model", "nosuch")
    assert_one_error_line(code, out, err, "--draft-model nosuch", "local models: tiny")

    with pytest.raises(NtxError, match="in use by running instance 'big'.*ntxctl stop --name big"):
        model_store.remove_model("tiny", {"big": [str(cache / "models" / "tiny.gguf")]})
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "rm", "nosuch")
    assert_one_error_line(code, out, err, "no local model named nosuch", "local models: tiny")
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "rm", "tiny")
    assert code == 0, err
    assert out.strip().splitlines() == [f"removed tiny (tiny.gguf, {format_bytes(len(tiny))}) from {cache / 'models'}"]
    assert _model_files(cache) == []


def test_hf_scheme_follows_the_redirect_and_checks_x_linked_etag(cache, server, tiny, monkeypatch):
    """Hugging Face's way on loopback ($HF_ENDPOINT): /resolve/ redirects to storage with the
    LFS sha256 in X-Linked-ETag; the token goes to the endpoint and not along the redirect."""
    served, base = server
    monkeypatch.setenv("HF_ENDPOINT", base)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    served.redirects["/o/r/resolve/v1/tiny.gguf"] = ("/storage/abc", {"X-Linked-Etag": f'"{_sha(tiny)}"',
                                                                      "ETag": '"0123"'})
    served.files["/storage/abc"] = (tiny, "application/octet-stream", {"ETag": '"' + "cd" * 32 + '"'})
    got = model_pull.pull_model("hf://o/r@v1/tiny.gguf", progress=False)
    assert got.checked_against == ("X-Linked-ETag",) and got.paths[0].read_bytes() == tiny
    assert served.requests == [("/o/r/resolve/v1/tiny.gguf", None, "Bearer hf_secret"), ("/storage/abc", None, None)]

    served.redirects["/o/r/resolve/main/gone.gguf"] = ("/storage/gone", {})
    served.status["/storage/gone"] = 403
    with pytest.raises(NtxError, match="HTTP 403"):
        model_pull.pull_model("hf://o/r/gone.gguf", progress=False)
    served.status["/o/r/resolve/main/gated.gguf"] = 401
    with pytest.raises(NtxError, match="gated or private.*HF_TOKEN"):
        model_pull.pull_model("hf://o/r/gated.gguf", progress=False)


def test_hf_url_resolution(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    hf = "https://huggingface.co"
    assert model_pull.hf_url("hf://owner/repo/file.gguf") == f"{hf}/owner/repo/resolve/main/file.gguf"
    assert model_pull.hf_url("hf://owner/repo@v1.0/file.gguf") == f"{hf}/owner/repo/resolve/v1.0/file.gguf"
    assert (model_pull.hf_url("hf://bartowski/Llama-3.2-1B-GGUF/Q4_K_M/m-00001-of-00002.gguf")
            == f"{hf}/bartowski/Llama-3.2-1B-GGUF/resolve/main/Q4_K_M/m-00001-of-00002.gguf")
    assert (model_pull.hf_url("hf://o/r@refs%2Fpr%2F1/a b.gguf")
            == f"{hf}/o/r/resolve/refs%2Fpr%2F1/a%20b.gguf")
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.local:8080/")
    assert model_pull.source_url("hf://o/r/f.gguf") == "http://mirror.local:8080/o/r/resolve/main/f.gguf"
    for bad in ("hf://o/r", "hf://o//f.gguf", "hf://o/r@/f.gguf", "hf://o"):
        with pytest.raises(NtxError, match="expected hf://OWNER/REPO/FILE.gguf"):
            model_pull.hf_url(bad)


def test_split_urls_keep_the_folder_and_the_query(tmp_path):
    files = model_pull.pull_files("https://h.example/o/r/resolve/main/Q4/m-00003-of-00003.gguf?download=true",
                                  tmp_path)
    assert [f.url for f in files] == [f"https://h.example/o/r/resolve/main/Q4/m-0000{i}-of-00003.gguf?download=true"
                                      for i in (1, 2, 3)]
    assert [f.final for f in files] == [tmp_path / f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


@pytest.mark.parametrize("source, message", [
    ("ftp://h/m.gguf", "not something ntxctl pull fetches"),
    ("m.gguf", "not something ntxctl pull fetches"),
    ("https://h.example/m.bin", "not a .gguf file"),
    ("https://h.example/.hidden.gguf", "not one to keep"),
])
def test_bad_sources_are_one_line(cache, source, message):
    with pytest.raises(NtxError, match=message):
        model_pull.pull_model(source, progress=False)


def test_bad_sha256_and_default_pull_without_url(cache, monkeypatch, capsys):
    with pytest.raises(NtxError, match="expected 64 hex digits"):
        model_pull.pull_model("https://h.example/m.gguf", sha256="abc", progress=False)
    code, out, err = run_cli_inprocess(monkeypatch, capsys, "pull", "--sha256", "0" * 64)
    assert_one_error_line(code, out, err, "--sha256 is for a URL")


def test_a_file_not_pulled_by_ntxctl_is_not_overwritten(cache, server, tiny):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "tiny.gguf").write_bytes(b"mine")
    with pytest.raises(NtxError, match="ntxctl did not pull it.*--force"):
        model_pull.pull_model(f"{base}/tiny.gguf", progress=False)
    assert (cache / "models" / "tiny.gguf").read_bytes() == b"mine"
    model_pull.pull_model(f"{base}/tiny.gguf", force=True, progress=False)
    assert (cache / "models" / "tiny.gguf").read_bytes() == tiny


def test_two_pulls_of_one_file_do_not_mix(cache, server, tiny):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    (cache / "models").mkdir(parents=True)
    with open(cache / "models" / ".tiny.gguf.part", "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(NtxError, match="another ntxctl pull is fetching tiny.gguf"):
            model_pull.pull_model(f"{base}/tiny.gguf", progress=False)
    assert served.requests == []


def test_progress_bars_run(cache, server, tiny, capfd):
    served, base = server
    served.files["/tiny.gguf"] = (tiny, "application/octet-stream", {})
    model_pull.pull_model(f"{base}/tiny.gguf", progress=True)
    assert f"pulling tiny.gguf from {base}/tiny.gguf" in capfd.readouterr().err


def test_default_model_is_listed_by_its_name(cache, tiny):
    """The default model lies in the same folder: listed and taken by name like any other."""
    (cache / "models").mkdir(parents=True)
    (cache / "models" / models.DEFAULT_MODEL_FILE).write_bytes(tiny)
    assert [m.name for m in model_store.local_models()] == [models.DEFAULT_MODEL_FILE.removesuffix(".gguf")]
    assert model_store.resolve_model("SmolLM2-135M-Instruct.Q4_1") == str(models.default_model_path())
