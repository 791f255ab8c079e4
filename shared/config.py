"""An instance's configuration and where its run-time files live.

One named instance = one supervisor and its three daemons. Its run folder holds the pid file,
the ipc sockets and the state file; its logs live beside it under ``logs/``. Shared memory
segments carry the instance's prefix, so a stop (or a restart after a crash) can find and free
every one of them.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import shutil
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Self

from ntx.shared.errors import ConfigError
from ntx.shared.kernel_options import KernelOptions
from ntx.shared.kv_sizing import CTX_DEFAULT_CAP

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str | int, what: str = "size") -> int:
    """``"24GiB"`` -> bytes. Plain numbers are bytes; K/M/G/T are powers of 1000, KiB… of 1024."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"{what} {text!r} is not a size (examples: 0, 512MiB, 24GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_layers(text: str, what: str = "layers") -> list[int]:
    """``"0-9,12"`` -> [0, 1, ..., 9, 12]: layer ids as ranges and single ids."""
    out: list[int] = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"{what} {text!r} is not a list of layers (example: 0-9,12)")
        out.extend(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return sorted(set(out))


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def listen_is_local(listen: str) -> bool:
    """Whether only this machine can reach a listen address: ipc, or tcp on a loopback address."""
    if listen.startswith("ipc://"):
        return True
    host = listen.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # *, 0.0.0.0 is an address; an interface name or a host name may be any


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"instance name {name!r} must be 1-32 letters, digits, '.', '_' or '-'")
    return name


def run_root() -> Path:
    """Where instances keep their run folders: ``$NTX_RUN_DIR`` or ``/tmp/ntx-<uid>`` (short, for
    ipc socket paths, which Linux limits to 107 bytes)."""
    env = os.environ.get("NTX_RUN_DIR")
    return Path(env) if env else Path(f"/tmp/ntx-{os.getuid()}")


@dataclass(frozen=True)
class InstancePaths:
    name: str

    @property
    def root(self) -> Path:
        return run_root() / self.name

    @property
    def pid_file(self) -> Path:
        return self.root / "supervisor.pid"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def config_file(self) -> Path:
        return self.root / "config.json"

    def secret_file(self, taker: str) -> Path:
        """Where a secret (the HTTP API key) waits for ``taker`` (supervisor, gateway) to take it."""
        return self.root / f"{taker}.secret"

    @property
    def log_dir(self) -> Path:
        return run_root() / "logs" / self.name

    @property
    def control(self) -> str:
        return f"ipc://{self.root}/ctl.sock"

    def host_ring(self, gen: int) -> str:
        return f"ipc://{self.root}/ring-host-g{gen}.sock"

    def device_ring(self, gen: int) -> str:
        return f"ipc://{self.root}/ring-dev-g{gen}.sock"

    @property
    def shm_prefix(self) -> str:
        """Shared-memory names live in one flat namespace (/dev/shm) for the whole machine, so
        they carry the run folder's digest: two instances of one name under different run
        folders (two test runs, two users' NTX_RUN_DIR) never touch each other's segments."""
        digest = hashlib.sha256(str(run_root().resolve()).encode()).hexdigest()[:8]
        return f"ntx-{os.getuid()}-{digest}-{self.name}-"

    def shm_name(self, gen: int, what: str) -> str:
        return f"{self.shm_prefix}g{gen}-{what}"

    def socket_files(self) -> list[Path]:
        return sorted(self.root.glob("*.sock")) if self.root.exists() else []

    def remove_runtime(self) -> None:
        """Remove the run folder (sockets, pid, state); logs stay for post-mortems."""
        shutil.rmtree(self.root, ignore_errors=True)


DEFAULT_LISTEN = "tcp://127.0.0.1:5555"  # an instance's client address when none is given
# One way to name an instance, for every command: --name (or NTX_NAME); its client address is
# found from the name. --listen (or NTX_LISTEN) gives an address directly and wins.
NAME_ENV, LISTEN_ENV = "NTX_NAME", "NTX_LISTEN"
# ntxctl takes the HTTP API key from here (or --api-key) and hands it on by file (secret_file),
# never in the environment of the supervisor, the gateway or the daemons
API_KEY_ENV = "NTX_API_KEY"
MAX_DRAFT_TOKENS = 512
# --draft: drafting without a model (daemons/compute/lookup.py; lookahead: daemons/compute/lookahead.py)
LOOKUP_DRAFTS = ("ngram", "suffix", "lookahead")
LOG_LEVELS = ("debug", "info", "warning", "error")
BACKENDS = ("cuda", "cpu")
IO_MODES = ("auto", "direct", "buffered", "mmap")
PLACEMENTS = ("spread", "first")  # shared/plan.py's _resident_layers says what each means
MIN_RING_SLOTS, MAX_RING_SLOTS = 2, 64
MIN_CTX = 16  # an instance's smallest --ctx

_AS_FIELD = object()  # CliOption.cli_default: the field's own default


@dataclass(frozen=True)
class CliOption:
    """How a field of the configuration record is an option of ``ntxctl`` (``start``, ``serve``,
    and the commands that take some of them): its flag is ``--`` and the field's name with ``-``
    for ``_``, its default the field's, and ``ctl/cli.py`` builds the option from this.

    ``read``: how the option's text becomes the field's value, where it is not the field's own
    type (``ctl/cli.py``'s readers: ``size``, ``path``, ``model`` (a path or a local model's name),
    ``backend``, ``auto_or_count``, ``layer_count``, ``all_or_layers``, ``layers_or_profile``,
    ``replay_file``); ``cli_default``: the text the
    command line shows for the field's default, where that is not the default itself (``auto``
    for a width of None); ``deprecated``: older flags, hidden, that still work and warn."""

    help: str
    read: str | None = None
    cli_default: Any = _AS_FIELD
    short: str | None = None
    envvar: str | None = None
    deprecated: tuple[str, ...] = ()

    def default_text(self, f: Field) -> Any:
        """The option's default as the command line holds it: None (not given) for a field that
        is read from text, unless ``cli_default`` says otherwise."""
        if self.cli_default is not _AS_FIELD:
            return self.cli_default
        return None if self.read is not None or f.default is MISSING else f.default


def _option(default: Any = MISSING, help: str = "", **kw: Any) -> Any:
    """A record field that is also an ntxctl option (``CliOption``)."""
    return field(default=default, metadata={"cli": CliOption(help, **kw)})


def _inner(default: Any) -> Any:
    """A record field that is no option: benchmarks and tests set it, the command line keeps its default."""
    return field(default=default)


def cli_option(f: Field) -> CliOption | None:
    """``f``'s ``CliOption``, or None for a field that is no option."""
    return f.metadata.get("cli")


def largest_pass_rows(prefill_chunk_tokens: int, max_batch: int, draft_tokens: int) -> int:
    """The most rows one pass can take: a prompt chunk beside a decode row for every other
    sequence of the batch, or every sequence decoding with its draft of ``draft_tokens`` (0: no
    drafter). The drafts of a pass that carries a prompt chunk take only the rows the chunk leaves
    (``EngineCore._propose_drafts``): with them beside a full chunk, a batch-64 engine drafting 16
    tokens would take 1,583 rows, and on the 70B at 24 GiB drafting at all would cost a resident
    layer (the pass's workspace). The warm-up records the row buckets up to it and the planner
    reserves its workspace (the cuda backend's eager arena), from this one function so that the
    two cannot drift."""
    return max(prefill_chunk_tokens + max_batch - 1, max_batch * (1 + draft_tokens))


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What shapes an engine: its batch and context, the layers it never runs, its kernels and its
    drafter. ``daemons/compute/factory.build_engine`` builds every engine from one of these (the
    compute daemon from the instance's ``InstanceConfig``, which is one; ``generate --local``,
    perplexity, calibrate, the benchmarks and the tests from their own). Each field is the
    ``ntxctl`` option of the same name (``CliOption``), with its default and rule here only."""

    max_batch: int = _option(16, "sequences advanced per pass")
    ctx: int | None = _option(None, "context length per sequence (default: the model's trained context, at most "
                              f"{CTX_DEFAULT_CAP}); a longer one than the model was trained for is refused")
    prefill_chunk_tokens: int = _inner(512)  # prompt tokens per pass (beside decode rows: largest_pass_rows)
    skip_layers: list[int] | None = _option(None, "never run, read nor copy these layers: a list (20-27,29), a calibrate "
                                            "profile (its layers at cos >= 0.98), or PROFILE:N (its N most similar "
                                            "layers)", read="layers_or_profile")
    kernels: str = _option("", "kernel switches, NAME=on|off separated by commas (cpu-quantized=off: the cpu "
                           "backend's float32 numpy reference; batch-invariant=on: cuda logits that do not depend "
                           "on the rows beside them) "
                           f"(default {KernelOptions().describe()})")
    # speculative decoding (daemons/compute/speculation.py): one drafter at most
    draft_model: str | None = _option(None, "draft with this small GGUF or local model (same vocabulary), resident",
                                      read="model")
    self_draft: bool | list[int] = _option(False, "draft with resident layers of the model: all, or a list (0-9,12)",
                                           read="all_or_layers")  # True: every resident layer
    self_draft_skip: list[int] | None = _option(None, "draft without these layers: a list, a calibrate profile, or "
                                                "PROFILE:N (its N most similar layers)", read="layers_or_profile")
    draft: str | None = _option(None, "draft without a model: ngram (prompt lookup in the request's own text), "
                                      "suffix (and in the instance's recent requests) or lookahead (and n-grams the "
                                      "model guesses and tokens it ranks in spare verify rows: for --draft-tokens "
                                      "16 or more); with "
                                      "--draft-model or --self-draft, their trees are merged")
    draft_tokens: int = _option(4, f"tokens drafted per sequence and pass (1-{MAX_DRAFT_TOKENS})")
    draft_width: int | None = _option(None, "the draft tree's width (1 = a chain), or auto: chosen from measured "
                                      "acceptance", read="auto_or_count", cli_default="auto")
    # benchmarks only (daemons/compute/replay.py): recorded greedy continuations as the draft,
    # each token made wrong with this probability; the drafter above, if any, runs and is ignored
    draft_replay: str | None = _option(None, "for benchmarks: draft a recorded greedy continuation (JSON from "
                                       "`ntxctl bench --scenarios spec`); the drafter named otherwise runs and is "
                                       "ignored", read="replay_file")
    draft_replay_p: float = _option(0.0, "for benchmarks: probability that each replayed draft token is made wrong")
    # benchmarks timing one tree shape: draft --draft-tokens every pass (a chain unless --draft-width),
    # never backing off nor probing (speculation.TreeShape, fixed)
    draft_fixed: bool = _inner(False)

    @property
    def drafting(self) -> bool:
        """Whether the engine has a drafter: a draft model, its own layers, lookups or a replay."""
        return (self.draft_model is not None or self.drafts_itself or self.draft is not None
                or self.draft_replay is not None)

    @property
    def largest_pass_rows(self) -> int:
        """The most rows one pass of this engine can take (``largest_pass_rows``): what its
        warm-up covers and the planner reserves the workspace of."""
        return largest_pass_rows(self.prefill_chunk_tokens, self.max_batch, self.draft_tokens if self.drafting else 0)

    @property
    def drafts_itself(self) -> bool:
        """Whether the drafter is the model's own resident layers (``--self-draft``, or implied by
        ``--self-draft-skip``)."""
        return self.self_draft is not False or self.self_draft_skip is not None

    @property
    def self_draft_layers(self) -> list[int] | None:
        """The resident layers a self-draft uses, before ``self_draft_skip``; None: all of them."""
        return None if self.self_draft in (True, False) else list(self.self_draft)

    @property
    def kernel_options(self) -> KernelOptions:
        return KernelOptions.parse(self.kernels)

    def ctx_for(self, n_ctx_train: int) -> int:
        """The context a sequence may reach on a model trained for ``n_ctx_train`` positions:
        ``--ctx``, or by default the trained context capped at ``CTX_DEFAULT_CAP``. A ``--ctx``
        beyond the trained context is refused (positions the model never saw give it no sense)."""
        if self.ctx is None:
            return min(n_ctx_train, CTX_DEFAULT_CAP)
        if self.ctx > n_ctx_train:
            raise ConfigError(f"--ctx {self.ctx}: the model was trained for {n_ctx_train} positions; choose at most "
                              f"{n_ctx_train}, or leave --ctx out (its default: {min(n_ctx_train, CTX_DEFAULT_CAP)})")
        return self.ctx

    def for_model(self, n_ctx_train: int) -> Self:
        """These options with ``ctx`` resolved for the model: its default, or at most the trained
        context (an engine in this process takes a longer one as the longest it can)."""
        ctx = min(n_ctx_train, CTX_DEFAULT_CAP) if self.ctx is None else min(self.ctx, n_ctx_train)
        return self if ctx == self.ctx else replace(self, ctx=ctx)

    def validate(self) -> Self:
        """Raise ConfigError (one line naming the option and the fix) unless every value can be
        honoured; returns self. Subclasses add their own rules."""
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch {self.max_batch}: must be at least 1")
        self.kernel_options  # noqa: B018 - parsed for its ConfigError
        if self.draft is not None and self.draft not in LOOKUP_DRAFTS:
            raise ConfigError(f"--draft {self.draft}: choose {', '.join(LOOKUP_DRAFTS[:-1])} or {LOOKUP_DRAFTS[-1]}")
        if self.draft_model is not None and self.drafts_itself:
            raise ConfigError("choose one drafter: --self-draft or --draft-model, not both")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"--draft-tokens {self.draft_tokens}: choose 1 to {MAX_DRAFT_TOKENS}")
        if self.draft_width is not None and not 1 <= self.draft_width <= self.draft_tokens:
            raise ConfigError(f"--draft-width {self.draft_width}: choose auto or 1 to --draft-tokens ({self.draft_tokens})")
        if not 0.0 <= self.draft_replay_p <= 1.0:
            raise ConfigError(f"--draft-replay-p {self.draft_replay_p}: a probability, from 0 to 1")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """The record ``to_dict`` wrote, every key present and none other: the two ends of the
        wire are one version of ntx, so a difference is a clear error, never a silent default."""
        names = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(d) - names), sorted(names - set(d))
        if unknown or missing:
            raise ConfigError(f"{cls.__name__}: " + "; ".join(
                f"{what} {', '.join(keys)}" for what, keys in (("unknown keys", unknown), ("missing keys", missing)) if keys)
                + ": written by another version of ntx; restart the instance with this one")
        return cls(**d)


@dataclass(frozen=True, kw_only=True)
class InstanceConfig(EngineOptions):
    """What ``ntxctl start`` (or ``serve``) asked for: every option of those commands is a field
    of the same name (``CliOption``), the engine's among them (``EngineOptions``). Written to the
    instance's run folder, read by the supervisor, and sent to every daemon inside its ``config``
    message (``to_dict`` / ``from_dict``)."""

    model: str = _option(help="GGUF file or local model name (default: SmolLM2-135M, pulled on first use)",
                         read="model", short="-m")
    name: str = _option("default", "instance name", envvar=NAME_ENV)
    backend: str = _option("cpu", "cuda, cpu or auto (cuda when a GPU and cupy are present)", read="backend",
                           cli_default="auto")
    listen: str = _option(DEFAULT_LISTEN, "client address (ZeroMQ ROUTER)", envvar=LISTEN_ENV)
    ring_slots: int = _option(2, "ring slots per side (2 = double buffering)", deprecated=("--slots",))
    vram_budget: int | None = _option(None, "e.g. 24GiB (default: free device memory)", read="size")  # bytes
    ram_budget: int | None = _option(None, "pinned RAM for layers, e.g. 64GiB", read="size")  # bytes; None: from available RAM
    gpu_layers: int | None = _option(None, "at most this many resident layers; all (or -1, as llama.cpp's -ngl): "
                                     "every layer that fits the budget", read="layer_count",
                                     cli_default="all")  # like llama.cpp's -ngl; None: no cap
    cpu_layers: int | None = _option(None, "layers kept in host RAM and computed by the host's cores beside the "
                                     "streamed ones (the cpu tier): a number, or auto (cuda: split by the link's and "
                                     "the host's speeds measured at start; cpu: none)", read="auto_or_count",
                                     cli_default="auto")  # None: auto
    placement: str = _option("spread", "where resident layers sit when not all fit: spread (evenly over the model, "
                             "so streamed copies overlap resident compute) or first")
    io: str = _option("auto", "storage reads: auto, direct, buffered or mmap")
    timeout: float = _option(120.0, "seconds each daemon may take to get ready")
    max_restarts: int = _option(3, "restarts within 5 minutes before giving up")
    # liveness (ctl/generations.py): a ready daemon silent this long is killed and the pipeline
    # restarted; it is reported `stalled` long before (STALL_REPORT_S)
    stall_timeout: float = _option(60.0, "seconds a ready daemon may send no stats before the pipeline is "
                                   "restarted (it shows as stalled after 3 s)")
    # the HTTP gateway (ctl/gateway): HOST:PORT, or None for none; its key travels by a file
    # each taker deletes (InstancePaths.secret_file), never in this record, which every daemon receives
    http: str | None = _option(None, "also serve OpenAI's API, /metrics, /health and a live status page on "
                               "HOST:PORT (example: 127.0.0.1:8080)")
    log_level: str = _option("info", "debug, info, warning or error: info logs one line per request "
                             "(supervisor.log), the gateway logs at this level")
    # CURVE on the client socket (ctl/front.py), required when other machines can reach --listen
    curve_server_key: str | None = _option(None, "CURVE: the server's secret key file (`ntxctl keygen`); required "
                                           "when --listen is not loopback", read="path")
    curve_clients: str | None = _option(None, "CURVE: folder of the public key files (NAME.key) of the clients "
                                        "let in", read="path")
    read_queue_depth: int = _inner(4)  # the reader's reads in flight per file
    read_chunk_bytes: int = _inner(8 << 20)  # the reader's largest single read

    @classmethod
    def options(cls) -> list[Field]:
        """The fields that are ntxctl options, in the order ``--help`` lists them: the instance's
        own, then the engine's."""
        own = [f for f in fields(cls) if f.name in cls.__annotations__]
        return [f for f in own + [f for f in fields(EngineOptions)] if cli_option(f) is not None]

    @property
    def cpu_tier_barred(self) -> str | None:
        """Why no layer may go to the cpu tier under these options (None: they may). The
        batch-invariant mode promises a row the same bits whatever its pass's width, but on cuda
        the tier computes a narrow pass's layers on the host's cores and a wide pass's on the GPU
        (host_tier.py, WIDE_PASS_ROWS): two kernels, two sets of bits."""
        if self.backend != "cpu" and self.kernel_options.batch_invariant:
            return ("under --kernels batch-invariant=on the cpu tier would run its layers on the host's cores in "
                    "narrow passes and on the GPU in wide ones, so a row's bits would depend on its pass's width")
        return None

    def validate(self) -> Self:
        super().validate()
        check_name(self.name)
        if self.ctx is not None and self.ctx < MIN_CTX:
            raise ConfigError(f"--ctx {self.ctx}: must be at least {MIN_CTX}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r}: choose {' or '.join(BACKENDS)}")
        if not MIN_RING_SLOTS <= self.ring_slots <= MAX_RING_SLOTS:
            raise ConfigError(f"--ring-slots {self.ring_slots}: need between {MIN_RING_SLOTS} and {MAX_RING_SLOTS} slots")
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise ConfigError(f"--gpu-layers {self.gpu_layers}: must be 0 or more")
        if self.cpu_layers is not None and self.cpu_layers < 0:
            raise ConfigError(f"--cpu-layers {self.cpu_layers}: must be 0 or more, or auto")
        barred = self.cpu_tier_barred if self.cpu_layers else None
        if barred:
            raise ConfigError(f"--cpu-layers {self.cpu_layers}: {barred}; give --cpu-layers 0 (auto places none in this "
                              "mode) or leave batch-invariant off")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement {self.placement!r}: choose {' or '.join(PLACEMENTS)}")
        if self.io not in IO_MODES:
            raise ConfigError(f"--io {self.io!r}: choose {', '.join(IO_MODES[:-1])} or {IO_MODES[-1]}")
        if not 10.0 <= self.stall_timeout <= 86400.0:
            raise ConfigError(f"--stall-timeout {self.stall_timeout:g}: give 10 to 86400 seconds")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be 0 or more")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: choose {', '.join(LOG_LEVELS)}")
        if not self.listen.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--listen {self.listen!r}: expected tcp://HOST:PORT or ipc://PATH")
        if (self.curve_server_key is None) != (self.curve_clients is None):
            raise ConfigError("CURVE needs both --curve-server-key and --curve-clients")
        if self.curve_server_key is not None and not os.path.isfile(self.curve_server_key):
            raise ConfigError(f"--curve-server-key {self.curve_server_key}: no such file")
        if self.curve_clients is not None and not os.path.isdir(self.curve_clients):
            raise ConfigError(f"--curve-clients {self.curve_clients}: no such folder (it holds the clients' NAME.key files)")
        if self.curve_server_key is None and not listen_is_local(self.listen):
            raise ConfigError(f"--listen {self.listen}: other machines can reach it, so clients must authenticate: "
                              "make keys with `ntxctl keygen` and give --curve-server-key and --curve-clients")
        return self
