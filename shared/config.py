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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ntx.shared.errors import ConfigError

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


MAX_DRAFT_TOKENS = 512
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class InstanceConfig:
    """What ``ntxctl start`` asked for; travels to every daemon inside its ``config`` message."""

    model: str
    name: str = "default"
    backend: str = "cpu"
    listen: str = "tcp://127.0.0.1:5555"
    slots: int = 2
    vram_budget: int | None = None  # bytes; None = from free device memory
    ram_budget: int | None = None  # bytes; None = from available RAM
    max_vram_layers: int | None = None  # cap on resident layers (like llama.cpp's -ngl)
    placement: str = "spread"  # resident layers spread over the model, or the first ones (shared/plan.py)
    skip_layers: list[int] | None = None  # never run, read nor copied (``--skip-layers``; ctl/calibrate.py)
    io_mode: str = "auto"
    max_batch: int = 16
    max_context: int = 4096
    prefill_chunk_tokens: int = 512
    handshake_timeout_s: float = 120.0
    max_restarts: int = 3
    read_queue_depth: int = 4
    read_chunk_bytes: int = 8 << 20
    # speculative decoding (daemons/compute/speculation.py): one drafter at most
    draft_model: str | None = None  # a small GGUF of the target's vocabulary, resident
    self_draft: bool = False  # draft with the target's resident layers
    self_draft_layers: list[int] | None = None  # those of them to use (None: all)
    self_draft_skip: list[int] | None = None  # and without these (e.g. a calibrate profile's most similar)
    draft_tokens: int = 4  # drafted per sequence and pass (the tree's node budget)
    draft_width: int | None = None  # the tree's width; None: chosen from measured acceptance
    # benchmarks only (daemons/compute/replay.py): recorded greedy continuations as the draft,
    # each token made wrong with this probability; the drafter above, if any, runs and is ignored
    draft_replay: str | None = None
    draft_replay_p_wrong: float = 0.0
    # the HTTP gateway (ctl/gateway): HOST:PORT, or None for none; its key travels in the
    # environment (NTX_API_KEY), never in this config, which every daemon receives
    http: str | None = None
    log_level: str = "info"  # the supervisor's request lines and the gateway's log (LOG_LEVELS)
    # CURVE on the client socket (ctl/front.py), required when other machines can reach --listen
    curve_server_key: str | None = None  # the server's secret key file (`ntxctl keygen`)
    curve_clients: str | None = None  # folder of the public key files of the clients let in

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InstanceConfig:
        return cls(**d)

    def validate(self) -> InstanceConfig:
        check_name(self.name)
        if self.backend not in ("cpu", "cuda"):
            raise ConfigError(f"--backend {self.backend!r}: choose cuda or cpu")
        if not 2 <= self.slots <= 64:
            raise ConfigError(f"--slots {self.slots}: need between 2 and 64 slots")
        if self.io_mode not in ("auto", "direct", "buffered", "mmap"):
            raise ConfigError(f"--io {self.io_mode!r}: choose auto, direct, buffered or mmap")
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch {self.max_batch}: must be at least 1")
        if self.max_context < 16:
            raise ConfigError(f"--ctx {self.max_context}: must be at least 16")
        if self.draft_model is not None and self.self_draft:
            raise ConfigError("choose one drafter: --self-draft or --draft-model, not both")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"--draft-tokens {self.draft_tokens}: choose 1 to {MAX_DRAFT_TOKENS}")
        if self.draft_width is not None and not 1 <= self.draft_width <= self.draft_tokens:
            raise ConfigError(f"--draft-width {self.draft_width}: choose auto or 1 to --draft-tokens ({self.draft_tokens})")
        if not 0.0 <= self.draft_replay_p_wrong <= 1.0:
            raise ConfigError(f"--draft-replay-p {self.draft_replay_p_wrong}: a probability, from 0 to 1")
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
