"""Pulling a GGUF by URL into the models folder: ``ntxctl pull URL`` and
``ntxctl pull hf://OWNER/REPO/FILE.gguf``.

Sources. An http(s) URL of a ``.gguf`` file, or ``hf://OWNER/REPO[@REVISION]/PATH.gguf``: Hugging
Face's download URL ``https://huggingface.co/OWNER/REPO/resolve/REVISION/PATH.gguf`` (REVISION
``main`` when not given). As for huggingface_hub, ``$HF_ENDPOINT`` replaces that host and
``$HF_TOKEN`` (gated and private repositories) is sent to that host only, never along a redirect
to its storage. A file named as a shard of a split set (llama.cpp's ``STEM-00002-of-00003.gguf``)
pulls the whole set, each shard from the given URL with its own file name; ntx loads a split set
from any of its shards.

Resume. Each file is fetched into ``.NAME.part`` beside its final place and only appended to, so
the part is always a prefix of the file. A cut connection is resumed in the same run by an HTTP
``Range`` request from the part's length (``RETRY_DELAYS_S``: the pauses between tries that bring
no new byte); when those run out, or on Ctrl-C, the part is kept and the same command resumes
it. A server that ignores Range (200, not 206) starts the file over. A lock on the part keeps
two pulls of one file apart.

Checks, all before anything lands under a final name: the first bytes must be GGUF's magic (an
HTML page, a JSON error or a login page is refused at once, saying what the server sent); the
size must be the server's (Content-Length, Content-Range's total); the sha256 must be
``--sha256``'s, else the server's where it sends one (Hugging Face sends an LFS file's sha256 as
``X-Linked-ETag`` on the redirect to its storage; an ``ETag`` of 64 hex digits is taken as one
too), else it is only recorded; and the whole model, every shard, must open with ntx's GGUF index
(``open_model``). A file that fails its checksum or the index is deleted. Then each part is
renamed into place (``os.replace``) and its sidecar ``NAME.gguf.json`` written (the url, the
sha256 and size, and what the sha256 was checked against), as for the default model
(ctl/models.py, whose folder and sidecar helpers this module uses).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import os
import pathlib
import posixpath
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from email.message import Message

from ntx.ctl.models import cached_ok, fsync_dir, models_dir, read_sidecar, sidecar_path, write_sidecar
from ntx.shared.config import format_bytes
from ntx.shared.errors import ModelError, NtxError
from ntx.shared.gguf_index import GGUF_MAGIC, open_model, split_file_name, split_name

HF_SCHEME = "hf://"
HF_ENDPOINT_ENV = "HF_ENDPOINT"
HF_TOKEN_ENV = "HF_TOKEN"
HF_DEFAULT_ENDPOINT = "https://huggingface.co"

TIMEOUT_S = 60.0  # one connect, or one read of the body, before the try counts as cut
RETRY_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 20.0)  # pauses before the tries after one that brought no byte
_CHUNK_BYTES = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


# ---------------------------------------------------------------------------------------------
# Where a pull comes from and lands


def hf_url(spec: str) -> str:
    """``hf://OWNER/REPO[@REVISION]/PATH`` -> Hugging Face's download URL for it."""
    parts = spec[len(HF_SCHEME):].split("/")
    repo, at, revision = parts[1].partition("@") if len(parts) > 1 else ("", "", "")
    if len(parts) < 3 or not all(parts) or not repo or (at and not revision):
        raise NtxError(f"{spec}: expected hf://OWNER/REPO/FILE.gguf or hf://OWNER/REPO@REVISION/FILE.gguf")
    endpoint = (os.environ.get(HF_ENDPOINT_ENV) or HF_DEFAULT_ENDPOINT).rstrip("/")
    quote = urllib.parse.quote
    path = "/".join(quote(urllib.parse.unquote(p)) for p in parts[2:])
    revision = quote(urllib.parse.unquote(revision or "main"), safe="")
    return f"{endpoint}/{quote(parts[0])}/{quote(repo)}/resolve/{revision}/{path}"


def source_url(source: str) -> str:
    """The http(s) URL ``ntxctl pull SOURCE`` fetches."""
    if source.startswith(HF_SCHEME):
        return hf_url(source)
    if urllib.parse.urlsplit(source).scheme.lower() in ("http", "https"):
        return source
    raise NtxError(f"{source}: not something ntxctl pull fetches; give an http(s) URL of a .gguf file or "
                   f"hf://OWNER/REPO/FILE.gguf (`ntxctl pull` alone fetches the default model)")


@dataclass(frozen=True)
class PullFile:
    """One file of a pull: its URL and its final place in the models folder."""

    url: str
    final: pathlib.Path

    @property
    def part(self) -> pathlib.Path:
        """Where its bytes gather until it is verified (hidden: not a model to ``ntxctl list``)."""
        return self.final.with_name(f".{self.final.name}.part")


def pull_files(url: str, folder: pathlib.Path) -> list[PullFile]:
    """The files a pull of ``url`` fetches into ``folder``: the one file, or every shard of the
    split set it is a shard of."""
    parts = urllib.parse.urlsplit(url)
    name = urllib.parse.unquote(posixpath.basename(parts.path))
    if not name.endswith(".gguf"):
        raise NtxError(f"{url}: names {name or 'no file'!r}, not a .gguf file; give the URL of a GGUF file")
    if name.startswith(".") or "/" in name or "\0" in name:
        raise NtxError(f"{url}: the file name {name!r} is not one to keep in the models folder")
    split = split_name(name)
    if split is None or not 1 <= split[1] <= split[2]:
        return [PullFile(url, folder / name)]
    stem, _, count = split
    base = posixpath.dirname(parts.path)
    out = []
    for no in range(1, count + 1):
        shard = split_file_name(stem, no, count)
        shard_url = urllib.parse.urlunsplit(parts._replace(path=f"{base}/{urllib.parse.quote(shard)}"))
        out.append(PullFile(shard_url, folder / shard))
    return out


# ---------------------------------------------------------------------------------------------
# Public API


@dataclass(frozen=True)
class PullResult:
    """A model in place: its name, files and size, and what each file's sha256 was checked
    against (None: no checksum was offered, the sha256 is only recorded). ``fetched``: False
    when every file was already there and nothing was downloaded."""

    name: str
    paths: tuple[pathlib.Path, ...]
    size_bytes: int
    checked_against: tuple[str | None, ...]
    fetched: bool

    def checks_text(self) -> str:
        """What the sha256s were checked against, for the line ``ntxctl pull`` ends with."""
        against = sorted({c for c in self.checked_against if c})
        unchecked = self.checked_against.count(None)
        text = f"sha256 checked against {', '.join(against)}" if against else ""
        if unchecked:
            files = f"{unchecked} files" if len(self.paths) > 1 else "the file"
            text += ("; " if text else "") + f"no sha256 offered for {files} (recorded only)"
        return text


@dataclass
class _Fetched:
    file: PullFile
    sha256: str
    size: int
    checked_against: str | None


def pull_model(source: str, *, sha256: str | None = None, force: bool = False,
               progress: bool = True) -> PullResult:
    """Fetch the GGUF at ``source`` (a URL or hf://…; a split set: all its shards) into the models
    folder, verified, resumable; see the module's docstring. Files already there with their
    sidecar are kept unless ``force``. Raises NtxError (one line) for what the user can fix."""
    url = source_url(source)
    folder = models_dir()
    files = pull_files(url, folder)
    name = files[0].final.name
    expected = _given_sha256(sha256, files)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NtxError(f"cannot create the models folder {folder}: {e.strerror or e}") from None
    todo = files if force else [f for f in files if not cached_ok(f.final)]
    for f in todo:
        if not force and f.final.exists():
            raise NtxError(f"{f.final} is there already and ntxctl did not pull it (no sidecar); remove it, or pass "
                           f"--force to pull it again")
    what = f"{len(todo)} files of a split set" if len(files) > 1 else name
    fetched = []
    with _Bars(progress, f"ntxctl: pulling {what} from {url} into {folder}") as bars:
        for f in todo:
            fetched.append(_fetch(f, expected, bars))
    _check_loads(files, {d.file: d.file.part for d in fetched})
    for d in fetched:
        _land(d, source)
    fsync_dir(folder)
    checked = {d.file: d.checked_against for d in fetched}
    return PullResult(
        name=_model_name(name), paths=tuple(f.final for f in files),
        size_bytes=sum(f.final.stat().st_size for f in files),
        checked_against=tuple(checked[f] if f in checked else (read_sidecar(f.final) or {}).get("checked_against")
                              for f in files),
        fetched=bool(fetched),
    )


def _model_name(file_name: str) -> str:
    split = split_name(file_name)
    return split[0] if split else file_name.removesuffix(".gguf")


def _given_sha256(sha256: str | None, files: list[PullFile]) -> str | None:
    if sha256 is None:
        return None
    digest = sha256.strip().lower()
    if not _HEX64.fullmatch(digest):
        raise NtxError(f"--sha256 {sha256}: expected 64 hex digits (sha256sum's output)")
    if len(files) > 1:
        raise NtxError(f"--sha256 checks one file, and {files[0].final.name} is a shard of a set of {len(files)}: "
                       "leave --sha256 out (each shard is checked against the server's sha256 where it sends one)")
    return digest


# ---------------------------------------------------------------------------------------------
# One file: fetch with resume


class _Retry(Exception):
    """A try that ended before the file did (a cut connection, a server error worth another try)."""


class _Worthless(NtxError):
    """A download whose bytes are of no use (not a GGUF file, a wrong checksum): its part is deleted."""


class _Part:
    """The ``.part`` file of one download: always a prefix of the file, with the sha256 of the
    bytes it holds so far and what the server said of the whole."""

    def __init__(self, file: PullFile, f, bars: "_Bars") -> None:
        self.file = file
        self.f = f
        self.bars = bars
        self.task: int | None = None  # its bar, once the server answers
        self.size = 0
        self.hash = hashlib.sha256()
        self.head = b""
        self.total: int | None = None
        self.server_sha: tuple[str, str] | None = None  # (sha256, the header it came in)
        self.answered = False  # a server answered in this run: a failure to connect later is a cut
        with open(file.part, "rb") as prefix:  # resumed: the bytes an earlier run fetched
            while chunk := prefix.read(_CHUNK_BYTES):
                self._take(chunk)
        if self.size >= len(GGUF_MAGIC) and self.head != GGUF_MAGIC:
            self.restart()

    def _take(self, chunk: bytes) -> None:
        if len(self.head) < len(GGUF_MAGIC):
            self.head = (self.head + chunk)[:len(GGUF_MAGIC)]
        self.hash.update(chunk)
        self.size += len(chunk)
        if self.task is not None:
            self.bars.advance(self.task, len(chunk))

    def show(self, total: int | None) -> None:
        """The server sends the file (of ``total`` bytes, if it says so): its bar."""
        if self.task is None:
            self.task = self.bars.add(self.file.final.name, self.size, total)
        else:
            self.bars.update(self.task, self.size, total)

    def restart(self) -> None:
        """Drop what the part holds: the server starts the file over."""
        self.f.truncate(0)
        self.size = 0
        self.hash = hashlib.sha256()
        self.head = b""
        if self.task is not None:
            self.bars.update(self.task, 0, self.total)

    def write(self, chunk: bytes, url: str, content_type: str) -> None:
        """Append ``chunk``; refuse at once a body that does not start as a GGUF file does."""
        had_head = len(self.head) >= len(GGUF_MAGIC)
        self.f.write(chunk)
        self._take(chunk)
        if not had_head and len(self.head) >= len(GGUF_MAGIC):
            if self.head != GGUF_MAGIC:
                raise _Worthless(_not_gguf(url, content_type, self.head))
            self.show(self.total)


def _fetch(file: PullFile, expected_sha: str | None, bars: "_Bars") -> _Fetched:
    """Download ``file`` into its part (resuming what is there), checked for size and sha256."""
    name = file.final.name
    try:
        f = open(file.part, "ab")
    except OSError as e:
        raise NtxError(f"cannot write {file.part}: {e.strerror or e}") from None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NtxError(f"another ntxctl pull is fetching {name} now ({file.part}); let it finish") from None
        part = _Part(file, f, bars)
        try:
            _download_resuming(part)
            f.flush()
            os.fsync(f.fileno())
            got = part.hash.hexdigest()
            want, against = (expected_sha, "--sha256") if expected_sha else (part.server_sha or (None, None))
            if want is not None and got != want:
                raise _Worthless(f"checksum mismatch for {name}: sha256 {got} ({part.size} bytes), {against} says "
                                 f"{want}; nothing kept (pull again, or check the sha256)")
            if part.head != GGUF_MAGIC:
                raise _Worthless(_not_gguf(file.url, "", part.head))
            return _Fetched(file, got, part.size, against if want else None)
        except _Worthless:
            part.restart()
            raise
        except KeyboardInterrupt:
            if part.size:
                print(f"ntxctl: pull interrupted; {format_bytes(part.size)} of {name} kept in {file.part}: the "
                      f"same command resumes it", file=sys.stderr, flush=True)
            raise
        finally:
            if part.size == 0:  # nothing worth resuming (refused, worthless): no part left behind
                with contextlib.suppress(OSError):
                    file.part.unlink()


def _download_resuming(part: _Part) -> None:
    """Tries until the file is whole; a try that brings no byte waits out ``RETRY_DELAYS_S``
    in turn, and when they are spent the cut is reported (the part is kept)."""
    idle = 0
    while True:
        before = part.size
        try:
            _download(part)
            return
        except _Retry as e:
            reason = str(e)
        if part.size > before:
            idle = 0
        if idle >= len(RETRY_DELAYS_S):
            total = f" of {part.total}" if part.total is not None else ""
            raise NtxError(f"the download of {part.file.final.name} was cut at byte {part.size}{total} ({reason}) "
                           f"and did not resume; {part.file.part} is kept: the same command resumes it")
        time.sleep(RETRY_DELAYS_S[idle])
        idle += 1


class _RedirectHeaders(urllib.request.HTTPRedirectHandler):
    """Follows redirects as urllib does, keeping each redirect's headers: Hugging Face says an
    LFS file's sha256 on the redirect to its storage, not on the storage's answer."""

    def __init__(self, seen: list[Message]) -> None:
        self.seen = seen

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.seen.append(headers)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _request(url: str, offset: int) -> urllib.request.Request:
    from importlib.metadata import version

    headers = {"User-Agent": f"ntxctl/{version('ntransformer')}", "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    req = urllib.request.Request(url, headers=headers)
    token = os.environ.get(HF_TOKEN_ENV)
    if token and _is_hf(url):  # unredirected: never sent on to the storage a redirect names
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    return req


def _is_hf(url: str) -> bool:
    endpoint = urllib.parse.urlsplit(os.environ.get(HF_ENDPOINT_ENV) or HF_DEFAULT_ENDPOINT).netloc
    return urllib.parse.urlsplit(url).netloc == endpoint


def _download(part: _Part) -> None:
    """One try: ask for the bytes from the part's length on and append them."""
    url = part.file.url
    seen: list[Message] = []
    opener = urllib.request.build_opener(_RedirectHeaders(seen))
    try:
        resp = opener.open(_request(url, part.size), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        with e:
            _refused(part, e.code, e.reason, seen + [e.headers])
        return  # the part was whole already (416 for a range at its end)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        if part.answered:
            raise _Retry(f"cannot reach the server: {reason}") from None
        host = urllib.parse.urlsplit(url).netloc
        raise NtxError(f"cannot reach {host} for {url}: {reason}") from None
    part.answered = True
    with resp:
        if resp.status == 206:
            start, total = _content_range(resp.headers.get("Content-Range"))
            if start != part.size:
                part.restart()
                raise _Retry(f"the server sent bytes from {start}, not from {part.size}; starting over")
        else:
            if part.size:
                part.restart()  # the server ignores Range: the whole file again
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        part.total = total
        part.server_sha = _server_sha256(seen + [resp.headers])
        if part.task is not None or part.head == GGUF_MAGIC:
            part.show(total)  # else once the first bytes are a GGUF's: a page sent instead leaves no bar
        if total is not None:
            _check_space(part, total - part.size)
        content_type = resp.headers.get_content_type()
        while True:
            try:
                chunk = resp.read(_CHUNK_BYTES)
            except (OSError, http.client.HTTPException) as e:  # reset, timeout, IncompleteRead
                raise _Retry(f"connection cut: {type(e).__name__}") from None
            if not chunk:
                break
            part.write(chunk, url, content_type)
            if total is not None and part.size > total:
                raise _Worthless(f"{url}: the server sent more than the {total} bytes it announced; nothing kept")
    if total is not None and part.size < total:
        raise _Retry("the connection closed early")


def _refused(part: _Part, code: int, reason: str, answers: list[Message]) -> None:
    """An HTTP error answer (``answers``: the redirects' headers, then its own): done (a range
    at the end of a whole part), another try, or one line."""
    url = part.file.url
    if code == 416 and part.size:
        total = (answers[-1].get("Content-Range") or "").rpartition("/")[2]
        if total.isdigit() and int(total) == part.size:
            part.total = part.size
            part.server_sha = _server_sha256(answers) or part.server_sha
            return
        part.restart()
        raise _Retry("the server refused to resume; starting over")
    if code in (408, 429) or code >= 500:
        raise _Retry(f"HTTP {code} {reason}")
    text = f"{url}: HTTP {code} {reason}"
    if code == 404:
        raise NtxError(f"{text}: no file there; check the URL (for Hugging Face: owner, repository, revision and "
                       f"file name)")
    if code in (401, 403) and _is_hf(url):
        raise NtxError(f"{text}: the repository is gated or private; accept its terms on the model's page and set "
                       f"{HF_TOKEN_ENV} to a token that may read it")
    raise NtxError(f"{text}: the server refuses this download")


def _content_range(value: str | None) -> tuple[int, int | None]:
    """(first byte, total size or None) of a 206's ``Content-Range``."""
    m = _CONTENT_RANGE.fullmatch((value or "").strip())
    if not m:
        raise _Retry(f"the server's Content-Range {value!r} cannot be read")
    return int(m[1]), (int(m[3]) if m[3] != "*" else None)


def _server_sha256(answers: list[Message]) -> tuple[str, str] | None:
    """The sha256 the server gives for the file, with the header it came in: ``X-Linked-ETag``
    of any answer along the redirects, else the last answer's ``ETag``, where it is 64 hex digits
    (a weak ETag never is a content hash)."""
    for headers in answers:
        digest = _hex64(headers.get("X-Linked-ETag"))
        if digest:
            return digest, "X-Linked-ETag"
    digest = _hex64(answers[-1].get("ETag"))
    return (digest, "ETag") if digest else None


def _hex64(value: str | None) -> str | None:
    if not value or value.startswith("W/"):
        return None
    digest = value.strip().strip('"').lower()
    return digest if _HEX64.fullmatch(digest) else None


def _check_space(part: _Part, need_bytes: int) -> None:
    free = shutil.disk_usage(part.file.part.parent).free
    if need_bytes > free:
        raise NtxError(f"not enough free space for {part.file.final.name} in {part.file.part.parent}: "
                       f"{format_bytes(need_bytes)} more needed, {format_bytes(free)} free")


def _not_gguf(url: str, content_type: str, head: bytes) -> str:
    """The line for a body that is not a GGUF file, saying what it is and, for a Hugging Face
    page URL, the download URL to give instead."""
    if content_type == "text/html" or head.lstrip()[:1] == b"<":
        what = "an HTML page"
    elif content_type == "application/json" or head.lstrip()[:1] in (b"{", b"["):
        what = "a JSON document"
    else:
        what = f"{content_type or 'a body'} starting {head!r}"
    hint = ""
    if "/blob/" in urllib.parse.urlsplit(url).path:
        hint = "; that is a page's URL: give its download URL (/resolve/, not /blob/) or hf://OWNER/REPO/FILE.gguf"
    return f"{url}: the server sent {what}, not a GGUF file; nothing kept{hint}"


# ---------------------------------------------------------------------------------------------
# The whole model: check, then land


def _check_loads(files: list[PullFile], parts: dict[PullFile, pathlib.Path]) -> None:
    """Open the model with ntx's index before it lands: every file under its final name (links in
    a scratch folder to the parts, or to the files already in place). A model that does not open
    is deleted (its parts) and is one line."""
    folder = files[0].final.parent
    with tempfile.TemporaryDirectory(prefix=".check-", dir=folder) as scratch:
        for f in files:
            os.symlink(parts.get(f, f.final), os.path.join(scratch, f.final.name))
        try:
            open_model(os.path.join(scratch, files[0].final.name))
        except ModelError as e:
            for p in parts.values():
                with contextlib.suppress(OSError):
                    p.unlink()
            kept = "; nothing kept" if parts else ""
            raise NtxError(f"{files[0].final.name} is a GGUF file, but ntx cannot load it: {e.problem}{kept}") from None


def _land(d: _Fetched, source: str) -> None:
    """Rename a verified part into place, then write its sidecar."""
    with contextlib.suppress(OSError):
        sidecar_path(d.file.final).unlink()
    os.replace(d.file.part, d.file.final)
    write_sidecar(d.file.final, {"sha256": d.sha256, "size": d.size, "url": d.file.url, "source": source,
                                 "checked_against": d.checked_against})


class _Bars:
    """Download bars on stderr (rich, as the default model's), one per file, under ``heading``
    (printed with the first bar: a server that refuses at once leaves only its error line);
    nothing when ``enabled`` is False."""

    def __init__(self, enabled: bool, heading: str) -> None:
        self.heading = heading
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))

    def __enter__(self) -> "_Bars":
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None and self.progress.live.is_started:
            self.progress.stop()

    def add(self, name: str, completed: int, total: int | None) -> int:
        if self.progress is None:
            return 0
        if not self.progress.live.is_started:
            print(self.heading, file=sys.stderr, flush=True)
            self.progress.start()
        return self.progress.add_task(name, completed=completed, total=total)

    def update(self, task: int, completed: int, total: int | None) -> None:
        if self.progress is not None:
            self.progress.update(task, completed=completed, total=total)

    def advance(self, task: int, n: int) -> None:
        if self.progress is not None:
            self.progress.advance(task, n)

