"""The tier plan: which layers live in compute's memory, which in pinned RAM, which stream from storage.

Reservations come first (as in ntransformer): the global tensors, the KV cache, the workspace
and — only when something streams — the device slots; then as many layers as fit the VRAM budget
stay resident, spread evenly over the model (``--placement spread``: a streamed layer's copy then
overlaps a resident layer's compute) or the first ones (``first``); the rest fills the RAM budget
(less the host staging slots, when something is left for storage), and whatever remains streams
from storage on every pass. Of the layers that do not fit, some may stay in host RAM and be
computed by the host's cores (the ``cpu`` tier, ``--cpu-layers``; daemons/compute/host_tier.py):
the link streams the others meanwhile, and ``cpu_split`` sizes the two shares from the
speeds measured at start (``HostRates``: the link, the cores, and the host memory both share). Layers the user skips
(``--skip-layers``: a calibrate profile's most input-like layers) take no tier at all: they
cost no memory, are never read nor copied, and the layers after them move up.

What a layer, the KV cache and the workspace cost is the backend's to say, not the planner's:
each backend reports a ``MemoryCosts`` (``Backend.memory_costs``) and the planner places layers
with it. On the cpu backend "VRAM" is the compute daemon's own memory, where a resident layer is
kept dequantized to float32, so the same plan logic runs in CI with costs that match that backend.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Sequence

import psutil

from ntx.shared.config import InstanceConfig, format_bytes
from ntx.shared.errors import ConfigError
from ntx.shared.gguf_index import ModelIndex
from ntx.shared.kv_sizing import FLOOR_TOKENS, PAGE_TOKENS, chunk_pages_for, pages_for_positions

VRAM, CPU, RAM, STORAGE, SKIPPED = "vram", "cpu", "ram", "storage", "skipped"
TIER_LABELS = {CPU: "host CPU", RAM: "pinned RAM", STORAGE: "storage", SKIPPED: "skipped"}  # the resident tier's: Plan.memory_name
DEVICE_RESERVE_BYTES = 512 << 20  # CUDA context, allocator slack
RAM_RESERVE_BYTES = 6 << 30  # what ntransformer leaves the rest of the system
# Passes of more rows than this run the cpu tier's layers on the GPU (streamed with the pass's other
# layers, daemons/compute/host_tier.py): the host's cores are bound by arithmetic there, and the int8
# products of 8 rows cost several times those of one, while the copy costs the same whatever the rows.
WIDE_PASS_ROWS = 4
KV_POOL_CAP_ROWS = 2  # the KV pool holds at most this many full contexts per --max-batch row (the rest: the prefix cache's)


@dataclass(frozen=True)
class MemoryCosts:
    """What a backend holds in its memory ("VRAM") for a model: reported by the backend
    (``Backend.memory_costs``), consumed by ``make_plan``."""

    memory_name: str  # what "VRAM" is on this backend, for the plan's lines
    layer_bytes: tuple[int, ...]  # per layer, its cost when resident
    globals_bytes: int  # token embedding, output norm and head
    kv_bytes_per_token: int  # all layers' keys and values of one position
    kv_tokens: int  # positions a pool sized without a plan holds (max_seqs at full context: a draft model's)
    workspace_bytes: int  # buffers of the largest pass
    # of globals_bytes, what the backend can keep in host memory instead, read there in place by
    # its kernels: the token embedding, of which a pass reads only its tokens' rows (0: none; a
    # tied head is the embedding, read whole every pass, so it stays)
    host_globals_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.kv_tokens

    @property
    def all_resident_bytes(self) -> int:
        """Everything held when every layer is resident (a draft model's footprint)."""
        return sum(self.layer_bytes) + self.globals_bytes + self.kv_bytes + self.workspace_bytes


@dataclass(frozen=True)
class HostRates:
    """The two roads' speeds, as the cpu tier's split needs them: ``link_gbps`` the host-to-device
    link (what a streamed layer's copy runs at), ``cpu_gbps`` the file bytes of a layer the host's
    cores compute per second in a one-row pass (decode at batch 1) with nothing else running,
    ``mem_gbps`` the host memory's read bandwidth, which both roads draw on (0: not measured, no
    sharing assumed). ``cpu_beside_link_gbps`` / ``link_beside_cpu_gbps``: each road's speed
    measured while the other runs (``probes.roads_together``; 0: not measured). Measured so because
    the two roads slow each other by more than the memory's bandwidth says: on the H200 host the
    cores computed the 70B's tier at ~32 GB/s in the pipeline against 44.5 alone, whether the
    link was busy or not. ``how``: where they came from, for the plan's line."""

    link_gbps: float
    cpu_gbps: float
    mem_gbps: float = 0.0
    how: str = "measured at start"
    cpu_beside_link_gbps: float = 0.0
    link_beside_cpu_gbps: float = 0.0
    gpu_gbps: float = 0.0  # file bytes the GPU multiplies by one row a second (0: its time not counted)

    def shared_gbps(self) -> tuple[float, float]:
        """(cores, link) in GB/s while both roads run: as measured together where they were,
        else the cores get what the memory leaves the link (``mem_gbps - link_gbps``, at most
        ``cpu_gbps``; all of it when the memory was not measured) and the link its own speed."""
        if self.cpu_beside_link_gbps:
            return self.cpu_beside_link_gbps, self.link_beside_cpu_gbps or self.link_gbps
        cpu = self.cpu_gbps if not self.mem_gbps else max(0.0, min(self.cpu_gbps, self.mem_gbps - self.link_gbps))
        return cpu, self.link_gbps

    def pass_s(self, cpu_bytes: int, streamed_bytes: int, gpu_bytes: int = 0) -> float:
        """A one-row pass's time on the two roads at once. A pass is one chain: the GPU computes
        ``gpu_bytes`` of layers (resident and streamed, at ``gpu_gbps``) and the host's cores the
        tier's ``cpu_bytes``, one after the other, while the link copies ``streamed_bytes`` for
        the layers ahead. While both roads run they go at their shared speeds (``shared_gbps``);
        when the link is done the chain goes on alone (its host part at ``cpu_gbps``), when the
        chain is done the link goes on at ``link_gbps``. (On the H200 host the memory-sharing
        model came within 5% of the 70B runs at 8 and 17 cpu-tier layers.)"""
        cpu_sh, link_sh = self.shared_gbps()
        gpu_s = gpu_bytes / (self.gpu_gbps * 1e9) if self.gpu_gbps and gpu_bytes else 0.0
        link_s = streamed_bytes / (link_sh * 1e9)
        host_s = cpu_bytes / (cpu_sh * 1e9) if cpu_sh > 0 else (float("inf") if cpu_bytes else 0.0)
        chain_s = host_s + gpu_s
        if link_s >= chain_s:  # the chain ends first (or is empty): the link runs on
            return chain_s + (streamed_bytes - link_sh * 1e9 * chain_s) / (self.link_gbps * 1e9)
        # the link ends first; the rest of the chain (host and GPU parts in proportion, the
        # GPU's spread along it) goes on without it
        host_share = host_s / chain_s
        return link_s + (chain_s - link_s) * ((1 - host_share) + host_share * cpu_sh / self.cpu_gbps)

    def describe(self) -> str:
        """The speeds in a few words, for the plan's lines."""
        text = f"link {self.link_gbps:.1f} GB/s, host cores {self.cpu_gbps:.1f} GB/s of weights alone"
        if self.cpu_beside_link_gbps:
            text += (f", {self.cpu_beside_link_gbps:.1f} beside the link (the link "
                     f"{self.link_beside_cpu_gbps or self.link_gbps:.1f} beside them)")
        elif self.mem_gbps:
            text += f", host memory {self.mem_gbps:.1f} GB/s shared with the link"
        if self.gpu_gbps:
            text += f", the GPU's products {self.gpu_gbps:.0f} GB/s"
        return text


def tier_wide_rows_for(backend: str) -> int | None:
    """Passes of more rows than this run the cpu tier's layers on ``backend`` (None: never): on
    cuda WIDE_PASS_ROWS; on the cpu backend never, unless NTX_TIER_WIDE_ROWS says (tests: a cpu
    pipeline's tier then streams its layers in wide passes as on a GPU)."""
    if backend == "cuda":
        return WIDE_PASS_ROWS
    env = os.environ.get("NTX_TIER_WIDE_ROWS")
    return int(env) if env else None


def cpu_split(layer_bytes: list[int], rates: HostRates, gpu_bytes: int = 0) -> int:
    """How many of the candidate layers (``layer_bytes`` each, taken evenly spread as
    ``spread_pick`` does) go to the cpu tier so that a one-row pass on both roads is fastest
    (``HostRates.pass_s``; the candidates not taken stream, and the GPU computes them beside its
    ``gpu_bytes`` of resident layers); ties to fewer."""
    n = len(layer_bytes)
    best_n, best_s = 0, float("inf")
    for count in range(n + 1):
        picked = set(spread_pick(list(range(n)), count))
        cpu = sum(b for i, b in enumerate(layer_bytes) if i in picked)
        streamed = sum(layer_bytes) - cpu
        t_s = rates.pass_s(cpu, streamed, gpu_bytes + streamed)
        if t_s < best_s * (1 - 1e-9):
            best_n, best_s = count, t_s
    return best_n


GPU, TIER, STREAMED = "gpu", "tier", "streamed"  # a layer's road in one pass (PassRoads.kinds)


@dataclass(frozen=True)
class PassRoads:
    """One pass's layers as the model runs them, in order, for choosing which of the cpu tier's
    layers it streams (``tier_streamed_in_pass``): each one's road (``GPU``: resident; ``TIER``:
    the cpu tier's; ``STREAMED``: over the link) and file bytes, and the device slots of the
    ring the streamed ones are copied into (a copy waits for a free slot)."""

    kinds: tuple[str, ...]
    layer_bytes: tuple[int, ...]
    slots: int


def ring_pass_s(kinds: Sequence[str], run_s: Sequence[float], copy_s: Sequence[float], slots: int) -> float:
    """One pass's time, layer by layer: the layers run in order, one at a time, each for its
    ``run_s`` (on the GPU, or on the host's cores for a ``TIER`` layer kept there); a
    ``STREAMED`` one runs once its copy has landed. The link copies the streamed layers in
    order, ``copy_s`` each, each into one of ``slots`` device slots, and a slot is free again
    once the layer it held has run. The slots are what a model of the two roads' bytes alone
    (``HostRates.pass_s``) misses: while the cores compute a long layer the link fills the free
    slots and then waits (on the H200 this replayed three 70B runs at batch 8 within 3%:
    docs/PERFORMANCE.md, "Part of the tier in passes of a few rows"; dev/pipeline/sim_ring.py)."""
    order = [i for i, k in enumerate(kinds) if k == STREAMED]
    slots = max(1, slots)  # a copy needs somewhere to land
    copy_end: dict[int, float] = {}
    ran: dict[int, float] = {}
    nxt, link_free = 0, 0.0

    def copy_what_fits() -> None:  # copies start as the link and a slot are free
        nonlocal nxt, link_free
        while nxt < len(order):
            start = link_free
            if nxt >= slots:
                holder = order[nxt - slots]  # the layer whose slot this copy takes
                if holder not in ran:
                    return
                start = max(start, ran[holder])
            link_free = start + copy_s[order[nxt]]
            copy_end[order[nxt]] = link_free
            nxt += 1

    copy_what_fits()
    t = 0.0
    for i, kind in enumerate(kinds):
        if kind == STREAMED:
            t = max(t, copy_end[i]) + run_s[i]
            ran[i] = t
            copy_what_fits()
        else:
            t += run_s[i]
    return t


def tier_share_pass_s(roads: PassRoads, rates: HostRates, host_slowdown: float, moved: Sequence[int]) -> float:
    """A pass's time (``ring_pass_s``) with the cpu tier's layers ``moved`` (indexes among
    ``roads``' ``TIER`` layers, in order) streamed with the others and the rest of the tier on
    the host's cores, each byte ``host_slowdown`` times a one-row pass's time there. The two roads
    run at their speeds beside each other (``HostRates.shared_gbps``); the GPU's layers at one
    row's speed (``gpu_gbps``; 0: not counted), which undercounts wide passes."""
    cpu_gbps, link_gbps = rates.shared_gbps()
    tier = [i for i, k in enumerate(roads.kinds) if k == TIER]
    streamed_tier = {tier[j] for j in moved}
    kinds, run_s = [], []
    for i, (kind, nbytes) in enumerate(zip(roads.kinds, roads.layer_bytes)):
        on_cores = kind == TIER and i not in streamed_tier
        kinds.append(TIER if on_cores else GPU if kind == GPU else STREAMED)
        if on_cores:
            run_s.append(nbytes * host_slowdown / (cpu_gbps * 1e9) if cpu_gbps > 0 else float("inf"))
        else:
            run_s.append(nbytes / (rates.gpu_gbps * 1e9) if rates.gpu_gbps else 0.0)
    copy_s = [b / (link_gbps * 1e9) if link_gbps > 0 else float("inf") for b in roads.layer_bytes]
    return ring_pass_s(kinds, run_s, copy_s, roads.slots)


def tier_streamed_in_pass(roads: PassRoads, rates: HostRates, host_slowdown: float,
                          min_gain: float = 0.0) -> list[int]:
    """Which of the cpu tier's layers (indexes among ``roads``' ``TIER`` layers, in order) a
    pass streams to the GPU with its other streamed layers, so that it ends soonest
    (``tier_share_pass_s``, layer by layer through the ring's slots), when the host's cores
    compute each byte ``host_slowdown`` times slower than in a one-row pass (a pass of several
    rows: verification, a batch; ``HostTier.host_slowdown``). Every share is tried, the layers
    kept on the cores spread among the tier's (``spread_pick``). The planner balanced the two
    roads for one row; a pass of 8 rows costs the cores several times that while a copy costs
    the same. A share that is not ``min_gain`` faster than streaming the whole tier streams the
    whole tier."""
    everything = list(range(sum(k == TIER for k in roads.kinds)))
    if not everything or min(rates.shared_gbps()) <= 0:
        return everything

    def moved(kept_count: int) -> list[int]:
        kept = set(spread_pick(everything, kept_count))
        return [j for j in everything if j not in kept]

    # by layers kept on the cores; none kept is the whole tier streamed
    pass_s = [tier_share_pass_s(roads, rates, host_slowdown, moved(n)) for n in range(len(everything) + 1)]
    best_n = min(range(len(pass_s)), key=pass_s.__getitem__)  # ties to fewer layers on the cores
    return everything if pass_s[best_n] > pass_s[0] * (1 - min_gain) else moved(best_n)


def spread_pick(items: list[int], count: int) -> list[int]:
    """``count`` of ``items`` spaced evenly (one in each of ``count`` equal stretches)."""
    count = min(count, len(items))
    if count <= 0:
        return []
    return [items[(2 * j + 1) * len(items) // (2 * count)] for j in range(count)]


@dataclass(frozen=True)
class Plan:
    tiers: tuple[str, ...]  # per layer: vram | cpu | ram | storage | skipped
    backend: str
    memory_name: str  # where "vram" layers live: VRAM on cuda, compute's own memory on cpu
    n_slots: int
    slot_bytes: int  # one slot (device or host) holds the largest layer
    vram_budget: int
    ram_budget: int
    globals_bytes: int
    kv_bytes: int  # the KV page pool at the start (the floor and what the layers left)
    kv_tokens: int  # positions it holds
    workspace_bytes: int
    draft_bytes: int  # a draft model's weights, KV cache and workspace (0 without one)
    device_slot_bytes_total: int
    host_slot_bytes_total: int
    vram_layer_bytes: int
    ram_layer_bytes: int
    storage_layer_bytes: int
    skipped_layer_bytes: int = 0  # the skipped layers' bytes in the file: what a pass no longer moves or holds
    # resident layers whose bytes dma also keeps in pinned RAM (loaded after ready), in the order
    # compute demotes them to streamed when the KV cache needs their memory (docs/ARCHITECTURE.md)
    standby_layers: tuple[int, ...] = ()
    standby_bytes: int = 0
    # the paged KV cache (shared/kv_sizing.py): pages of kv_page_bytes, kv_chunk_pages a chunk,
    # kv_chunks at the start (kv_floor_tokens of them reserved before any layer), at most
    # kv_max_chunks once every standby layer is demoted; ctx: positions a sequence may reach
    ctx: int = 0
    kv_page_bytes: int = 0
    kv_chunk_pages: int = 1
    kv_chunks: int = 0
    kv_max_chunks: int = 0
    kv_floor_tokens: int = 0
    # what makes layers stream, setting by setting, with its cost a pass (make_plan's _speed_notes)
    speed_notes: tuple[str, ...] = ()
    # the cpu tier: its layers' bytes in the file (what a pass reads on the host) and as held in
    # host RAM (the cpu kernels' forms), and the speeds its share was sized by (0: none given)
    cpu_layer_bytes: int = 0
    cpu_held_bytes: int = 0
    link_gbps: float = 0.0
    cpu_gbps: float = 0.0
    mem_gbps: float = 0.0
    rates_how: str = ""
    cpu_beside_link_gbps: float = 0.0
    link_beside_cpu_gbps: float = 0.0
    gpu_gbps: float = 0.0
    # the token embedding kept in (page-locked, mapped) host memory and read in place, leaving its
    # VRAM to layers: where the budget streams layers and the head is a tensor of its own
    # (MemoryCosts.host_globals_bytes); embed_host_bytes of it, not counted in globals_bytes
    embed_in_host: bool = False
    embed_host_bytes: int = 0
    # passes of more rows than this run the cpu tier's layers on the main backend (None: never;
    # on cuda WIDE_PASS_ROWS); where other layers stream, those passes stream the tier's layers
    # too, through the same ring (``wide_streamed_layers``: dma keeps their bytes with its RAM tier)
    tier_wide_rows: int | None = None
    # the rows of the largest pass the workspace holds (EngineOptions.largest_pass_rows): a prompt
    # chunk beside the other sequences' decode rows and drafts; 0 where the backend's workspace
    # does not depend on it (cpu)
    max_pass_rows: int = 0

    @property
    def predicted_pass_s(self) -> float:
        """A one-row pass's time by the cpu tier's model (``HostRates.pass_s``); 0 without its speeds."""
        rates = self.host_rates
        if rates is None:
            return 0.0
        return rates.pass_s(self.cpu_layer_bytes, self.streamed_bytes_per_pass,
                            self.vram_layer_bytes + self.streamed_bytes_per_pass)

    @property
    def host_rates(self) -> HostRates | None:
        """The speeds the cpu tier was sized by (None: none given)."""
        if not (self.link_gbps and self.cpu_gbps):
            return None
        return HostRates(self.link_gbps, self.cpu_gbps, self.mem_gbps, self.rates_how,
                         self.cpu_beside_link_gbps, self.link_beside_cpu_gbps, self.gpu_gbps)

    @property
    def kv_floor_bytes(self) -> int:
        """What the KV cache's floor takes, in whole chunks: reserved before any layer."""
        chunk = self.kv_chunk_pages * PAGE_TOKENS
        return -(-self.kv_floor_tokens // chunk) * self.kv_chunk_pages * self.kv_page_bytes

    @property
    def kv_max_tokens(self) -> int:
        """Positions the KV pool holds once every standby layer is demoted."""
        return self.kv_max_chunks * self.kv_chunk_pages * PAGE_TOKENS

    def layers_on(self, tier: str) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    @property
    def streamed_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t in (RAM, STORAGE)]

    @property
    def wide_streamed_layers(self) -> list[int]:
        """The cpu tier's layers that a pass wider than ``tier_wide_rows`` streams beside the
        streamed layers (their bytes in dma's pinned RAM): the tier's, where something streams on
        a tier that leaves the host in wide passes; else none (nothing streams: compute copies
        them itself, through one staging buffer)."""
        if self.tier_wide_rows is None or not self.streamed_layers:
            return []
        return self.layers_on(CPU)

    @property
    def streamed_bytes_per_pass(self) -> int:
        return self.ram_layer_bytes + self.storage_layer_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tiers"] = list(self.tiers)
        d["standby_layers"] = list(self.standby_layers)
        d["speed_notes"] = list(self.speed_notes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        d = dict(d)
        d["tiers"] = tuple(d["tiers"])
        d["standby_layers"] = tuple(d.get("standby_layers", ()))
        d["speed_notes"] = tuple(d.get("speed_notes", ()))
        return cls(**d)

    def tier_label(self, tier: str) -> str:
        """A tier's name as people read it: the resident tier is named by the backend's memory
        (``memory_name``: "VRAM" on cuda, "compute memory" on cpu, which has no VRAM)."""
        return self.memory_name if tier == VRAM else TIER_LABELS[tier]

    def tier_rows(self) -> list[dict]:
        """The resident, host CPU (when it holds layers), pinned-RAM and storage tiers, one row
        each: the tier's key, its label, how many layers and which, their bytes in the file
        (``describe``'s first lines; the status page's table)."""
        rows = []
        tiers = ((VRAM, self.vram_layer_bytes), (CPU, self.cpu_layer_bytes), (RAM, self.ram_layer_bytes),
                 (STORAGE, self.storage_layer_bytes))
        for tier, layer_bytes in tiers:
            if tier == CPU and not self.layers_on(CPU):
                continue
            layers = self.layers_on(tier)
            rows.append({"tier": tier, "label": self.tier_label(tier), "layers": len(layers), "which": _brief(layers),
                         "bytes": layer_bytes})
        return rows

    def describe(self) -> list[str]:
        """Human lines for ``--plan-only`` and ``status``: first one per ``tier_rows`` row."""
        rows = self.tier_rows()
        w = max(len(label) for label in [r["label"] for r in rows] + ["standby", SKIPPED])  # the label column
        lines = [f"{r['label']:{w}s} {r['layers']:4d} layers {r['which']:>14s}  {format_bytes(r['bytes']):>11s}"
                 for r in rows]
        lines.append(
            f"reserved in {self.memory_name}: globals {format_bytes(self.globals_bytes)}, "
            f"KV cache {format_bytes(self.kv_bytes)}, workspace {format_bytes(self.workspace_bytes)}"
            + (f" (passes of up to {self.max_pass_rows} rows)" if self.max_pass_rows else "") + ", "
            f"device slots {format_bytes(self.device_slot_bytes_total)}"
            + (f", draft model {format_bytes(self.draft_bytes)}" if self.draft_bytes else "")
            + f"; budget {format_bytes(self.vram_budget)}"
        )
        if self.embed_in_host:
            lines.append(f"token embedding in host memory: {format_bytes(self.embed_host_bytes)} (page-locked, its "
                         f"rows read in place), leaving its {self.memory_name} to layers")
        lines.extend(self.describe_kv())
        lines.append(
            f"pinned RAM: host slots {format_bytes(self.host_slot_bytes_total)}; budget {format_bytes(self.ram_budget)}; "
            f"{self.n_slots} slots of {format_bytes(self.slot_bytes)}"
        )
        lines.extend(self.describe_cpu())
        if self.standby_layers:
            lines.append(f"{'standby':{w}s} {len(self.standby_layers):4d} layers {_brief(sorted(self.standby_layers)):>14s}  "
                         f"{format_bytes(self.standby_bytes):>11s}  resident, also in pinned RAM: demoted to streamed "
                         "when the KV cache needs their memory")
        skipped = self.layers_on(SKIPPED)
        if skipped:
            lines.append(f"{SKIPPED:{w}s} {len(skipped):4d} layers {layer_ranges(skipped):>14s}  {format_bytes(self.skipped_layer_bytes):>11s}"
                         "  never read, copied nor run")
        lines.append(f"streamed per pass: {format_bytes(self.streamed_bytes_per_pass)}"
                     + (f" ({format_bytes(self.skipped_layer_bytes)} of skipped layers saved)" if skipped else ""))
        lines.extend(f"slower: {note}" for note in self.speed_notes)
        return lines


    def describe_cpu(self) -> list[str]:
        """The cpu tier's lines: what it holds in host RAM and, with the speeds it was sized by,
        each road's time a one-row pass (decode at batch 1)."""
        rates = self.host_rates
        if not self.layers_on(CPU):
            if rates:
                return [f"host CPU: no layer ({self.rates_how}: {rates.describe()}; streaming alone is as fast)"]
            return []
        lines = [f"host CPU: {len(self.layers_on(CPU))} layers held in host RAM as "
                 f"{format_bytes(self.cpu_held_bytes)} (inside the RAM budget"
                 + (f"; their file bytes too, for passes of more than {self.tier_wide_rows} rows, which run them on the "
                    + ("GPU" if self.backend == "cuda" else "backend")
                    + (", streamed with the others" if self.wide_streamed_layers else "")
                    if self.tier_wide_rows is not None else "")
                 + "), computed by the host's cores; only the hidden state crosses the link"]
        if rates:
            link_ms = self.streamed_bytes_per_pass / (self.link_gbps * 1e9) * 1e3
            lines.append(f"  a one-row pass: about {self.predicted_pass_s * 1e3:.0f} ms "
                         f"on the two roads: the link {link_ms:.0f} ms alone ({format_bytes(self.streamed_bytes_per_pass)}) "
                         f"while the host's cores read {format_bytes(self.cpu_layer_bytes)}; {rates.describe()}; "
                         f"{self.rates_how}")
        return lines

    def describe_kv(self) -> list[str]:
        """The KV cache's lines: the pool at the start, its floor, how far it grows and what
        happens as it fills (docs/ARCHITECTURE.md, "KV memory")."""
        page_tokens = PAGE_TOKENS
        grows = self.kv_max_chunks > self.kv_chunks
        lines = [f"KV cache: {self.kv_tokens} positions ({self.kv_tokens // page_tokens} pages of {page_tokens}, "
                 f"{format_bytes(self.kv_bytes)}) at the start, of which {self.kv_floor_tokens} reserved before any "
                 f"layer; --ctx {self.ctx} per sequence"]
        if grows:
            lines.append(f"  as it fills: grows to {self.kv_max_tokens} positions "
                         f"({format_bytes(self.kv_max_chunks * self.kv_chunk_pages * self.kv_page_bytes)}) by demoting "
                         "standby layers to streamed, one at a time (promoted back when pages free up); then ")
        else:
            lines.append("  as it fills: ")
        lines[-1] += ("cached prefixes are evicted, new requests wait for pages, and the newest running sequence is "
                      "preempted (resumed later by recomputing its keys and values)")
        return lines


def _brief(idx: list[int]) -> str:
    """``layer_ranges``, or for a long interleaved set its span (the full list is in ``tiers``)."""
    text = layer_ranges(idx)
    return text if len(text) <= 24 else f"within {idx[0]}-{idx[-1]}"


def layer_ranges(idx: list[int]) -> str:
    """Sorted layer ids as a person reads them: [0, 1, 2, 5] -> "0-2,5"."""
    if not idx:
        return "-"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def default_budgets(backend: str) -> tuple[int, int]:
    """(vram, ram) budgets when the user gives none."""
    avail = psutil.virtual_memory().available
    if backend == "cuda":
        free = _free_device_bytes()
        return max(free - DEVICE_RESERVE_BYTES, 0), max(avail - RAM_RESERVE_BYTES, 0)
    # cpu: compute keeps resident layers (as float32) in its own memory; the dma daemon pins RAM.
    return int(avail * 0.5), int(avail * 0.25)


def _free_device_bytes() -> int:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            return int(out.split()[0]) << 20
        except (subprocess.SubprocessError, ValueError, IndexError):
            pass
    raise ConfigError("cannot tell the GPU's free memory (no nvidia-smi): give --vram-budget")


def _resident_layers(kept: list[int], max_count: int, layer_costs: tuple[int, ...], avail_bytes: int,
                     placement: str) -> list[int]:
    """Which of the ``kept`` layers stay resident when not all of them fit in ``avail_bytes``.

    ``first``: the first ones, in order, while they fit. ``spread``: as many, spaced evenly over
    the model (one in each of ``count`` equal stretches of it), so that resident and streamed
    layers alternate. A pass then runs a resident layer while the next streamed one crosses the
    link: with the resident layers first, their compute and the copies of the streamed ones
    overlap only as far as the device slots reach, and a wide pass (a verified tree, a long
    prompt, a large batch) pays its resident compute on top of the link's time."""
    count, used = 0, 0
    for i in kept[:max_count]:
        if used + layer_costs[i] > avail_bytes:
            break
        count, used = count + 1, used + layer_costs[i]
    if placement == "first" or count == 0:
        return kept[:count]
    while True:  # layers differ a little in size (mixed quant types): fewer if the spread set is larger
        chosen = spread_pick(kept, count)
        if sum(layer_costs[i] for i in chosen) <= avail_bytes or count == 1:
            return chosen if sum(layer_costs[i] for i in chosen) <= avail_bytes else []
        count -= 1


def _resident_set(kept: list[int], cap: int, layer_costs: tuple[int, ...], avail_bytes: int, slots_bytes: int,
                  placement: str) -> list[int] | None:
    """The resident layers of ``kept`` with ``avail_bytes`` left for layers, at most ``cap`` of
    them: every one when all fit (nothing streams, no device slots), else those
    ``_resident_layers`` places in what the device slots (``slots_bytes``) leave; None when the
    slots alone do not fit."""
    if cap == len(kept) and sum(layer_costs[i] for i in kept) <= avail_bytes:
        return list(kept)
    if avail_bytes < slots_bytes:
        return None
    return _resident_layers(kept, cap, layer_costs, avail_bytes - slots_bytes, placement)


def _speed_notes(index: ModelIndex, cfg: InstanceConfig, kept: list[int], resident: list[int], resident_with,
                 *, cap: int, avail: int, vram_budget: int, floor: tuple[int, int], all_layers_bytes: int) -> list[str]:
    """What streams because of which setting, and what it costs a pass, for a plan that streams
    layers: each setting's plan is placed again without it (``resident_with(cap, avail_bytes)``:
    the resident layers at that cap and room) and the layers it moved off compared. The lines
    ``Plan.describe`` prints under "slower:"."""
    def streamed_bytes(res: list[int] | None) -> int:
        kept_res = set(res or ())
        return sum(index.layers[i].nbytes for i in kept if i not in kept_res)

    now = streamed_bytes(resident)
    notes = []
    uncapped = resident_with(len(kept), avail) or []
    if cfg.gpu_layers is not None and len(uncapped) > len(resident):
        notes.append(f"--gpu-layers {cfg.gpu_layers} streams {len(uncapped) - len(resident)} layers that fit the "
                     f"budget: {format_bytes(now - streamed_bytes(uncapped))} more to move every pass")
    if len(uncapped) < len(kept):
        budget = f"--vram-budget {format_bytes(vram_budget)}" + (" (the default, from the memory free now)"
                                                                 if cfg.vram_budget is None else "")
        notes.append(f"{budget} holds {len(uncapped)} of {len(kept)} layers: {len(kept) - len(uncapped)} stream, "
                     f"{format_bytes(streamed_bytes(uncapped))} every pass; every layer resident needs "
                     f"{format_bytes(vram_budget - avail + all_layers_bytes)}")
    floor_tokens, floor_bytes = floor
    unfloored = resident_with(cap, avail + floor_bytes) or []
    if len(unfloored) > len(resident):
        notes.append(f"the KV cache's floor ({floor_tokens} positions, {format_bytes(floor_bytes)}, reserved before "
                     f"any layer) streams {len(unfloored) - len(resident)} layers: "
                     f"{format_bytes(now - streamed_bytes(unfloored))} every pass (a shorter --ctx lowers it)")
    if notes and cfg.backend == "cpu":
        notes.append("on the cpu backend a streamed layer is also dequantized again on every pass")
    return notes


def demotion_order(resident: list[int]) -> list[int]:
    """The order in which resident layers give their memory to the KV cache: every other one
    first, then every other one of those left, and so on, so that the layers still resident stay
    spread over the model (a streamed layer's copy keeps overlapping a resident layer's compute).
    [0, 1, 2, 3, 4, 5, 6, 7] -> [1, 3, 5, 7, 2, 6, 4, 0]."""
    order: list[int] = []
    left = list(resident)
    while left:
        order += left[1::2]
        left = left[0::2]
        if len(left) == 1:
            order += left
            break
    return order


def make_plan(index: ModelIndex, cfg: InstanceConfig, costs: MemoryCosts, draft: MemoryCosts | None = None,
              rates: HostRates | None = None, host_layer_bytes: tuple[int, ...] | None = None) -> Plan:
    """Place every layer of ``index`` on a tier under ``cfg``'s budgets, with the memory the
    backend says it needs (``costs``) and, first, a draft model's whole footprint (``draft``).
    Of the layers left off the resident tier, ``cfg.cpu_layers`` (auto: ``cpu_split`` by
    ``rates``, on cuda only; none without rates) go to the cpu tier, spread among them, each
    holding ``host_layer_bytes`` of host RAM (the cpu kernels' forms; default its file bytes)
    out of the RAM budget.
    ``cfg.skip_layers`` are placed nowhere (tier ``skipped``); the cap ``cfg.gpu_layers``
    counts the layers that run; ``cfg.placement`` says where the resident ones sit
    (``_resident_layers``). ``cfg`` is validated (``InstanceConfig.validate``); the rules here
    are those that need the model."""
    backend = cfg.backend
    vram_default, ram_default = (None, None)
    if cfg.vram_budget is None or cfg.ram_budget is None:
        vram_default, ram_default = default_budgets(backend)
    vram_budget = cfg.vram_budget if cfg.vram_budget is not None else vram_default
    ram_budget = cfg.ram_budget if cfg.ram_budget is not None else ram_default

    hp = index.hparams
    ctx = cfg.ctx_for(hp.n_ctx_train)
    globals_bytes, workspace = costs.globals_bytes, costs.workspace_bytes
    # the KV cache: the floor first, then whatever the layers leave, in whole chunks; more than
    # KV_POOL_CAP_ROWS full-context sequences per --max-batch row would serve nobody
    page_bytes = PAGE_TOKENS * costs.kv_bytes_per_token
    chunk_pages = chunk_pages_for(page_bytes, min(costs.layer_bytes))
    chunk_bytes = chunk_pages * page_bytes
    want_chunks = -(-pages_for_positions(KV_POOL_CAP_ROWS * cfg.max_batch * ctx) // chunk_pages)
    floor_tokens = min(FLOOR_TOKENS, ctx)
    floor_chunks = -(-pages_for_positions(floor_tokens) // chunk_pages)
    kv_bytes = floor_chunks * chunk_bytes
    draft_bytes = draft.all_resident_bytes if draft is not None else 0
    slot_bytes = index.max_layer_image_bytes
    layer_costs = costs.layer_bytes
    n = hp.n_layers
    skip = set(cfg.skip_layers or ())
    bad = sorted(i for i in skip if not 0 <= i < n)
    if bad:
        raise ConfigError(f"--skip-layers {bad}: the model has layers 0-{n - 1}")
    if len(skip) >= n:
        raise ConfigError(f"--skip-layers skips all {n} layers: keep at least one")
    kept = [i for i in range(n) if i not in skip]

    avail = vram_budget - globals_bytes - kv_bytes - workspace - draft_bytes
    if avail + costs.host_globals_bytes < 0:
        with_draft = f" and the draft model ({format_bytes(draft_bytes)})" if draft_bytes else ""
        raise ConfigError(
            f"--vram-budget {format_bytes(vram_budget)} is too small: the global tensors, the KV cache's floor "
            f"({floor_tokens} positions) and the workspace{with_draft} alone need "
            f"{format_bytes(vram_budget - avail - costs.host_globals_bytes)}; "
            "raise it"
        )
    max_vram_layers = len(kept) if cfg.gpu_layers is None else min(cfg.gpu_layers, len(kept))
    tiers = [SKIPPED if i in skip else STORAGE for i in range(n)]
    # on cuda the cpu tier runs its layers on the device in wide passes: streamed through the
    # ring's slots beside the streamed layers, or where nothing else streams, copied by compute
    # through one staging buffer, which takes one of the ring slots' room (host_tier.py; reading
    # them from mapped host memory instead measured slower: dev/cuda/bench_mapped_weights.py)
    slots_bytes = cfg.ring_slots * slot_bytes

    def resident_with(cap: int, avail_bytes: int) -> list[int] | None:
        return _resident_set(kept, cap, layer_costs, avail_bytes, slots_bytes, cfg.placement)

    resident = resident_with(max_vram_layers, avail)
    embed_in_host = False
    if costs.host_globals_bytes and (resident is None or len(resident) < max_vram_layers):
        # the budget, not --gpu-layers, streams layers: the embedding's VRAM holds layers instead
        # (a pass reads a few of its rows over the link; a layer moved is a layer's bytes a pass)
        with_host = resident_with(max_vram_layers, avail + costs.host_globals_bytes)
        if with_host is not None and (resident is None or len(with_host) > len(resident)):
            resident, embed_in_host = with_host, True
            avail += costs.host_globals_bytes
            globals_bytes -= costs.host_globals_bytes
    if resident is None:
        raise ConfigError(
            f"--vram-budget {format_bytes(vram_budget)} is too small: with {cfg.ring_slots} device slots of "
            f"{format_bytes(slot_bytes)} it needs {format_bytes(vram_budget - avail + slots_bytes)}; raise it"
        )
    for i in resident:
        tiers[i] = VRAM
    device_slots_total = slots_bytes if len(resident) < len(kept) else 0
    speed_notes: list[str] = []
    if device_slots_total:
        speed_notes = _speed_notes(index, cfg, kept, resident, resident_with, cap=max_vram_layers, avail=avail,
                                   vram_budget=vram_budget, floor=(floor_tokens, kv_bytes),
                                   all_layers_bytes=sum(layer_costs[i] for i in kept)
                                   + (costs.host_globals_bytes if embed_in_host else 0))
        if cfg.cpu_tier_barred is not None:
            speed_notes.append(f"no cpu tier, every layer off the GPU streams: {cfg.cpu_tier_barred}")
    avail -= device_slots_total

    rest = [i for i in kept if tiers[i] != VRAM]
    ram_left = ram_budget - (costs.host_globals_bytes if embed_in_host else 0)  # the embedding's pages come first
    cpu_layers, cpu_held = _cpu_layers(index, cfg, rest, rates, host_layer_bytes, ram_left,
                                       sum(index.layers[i].nbytes for i in resident))
    for i in cpu_layers:
        tiers[i] = CPU
    tier_wide_rows = tier_wide_rows_for(backend) if cpu_layers else None
    if device_slots_total and all(tiers[i] in (VRAM, CPU) for i in kept):  # nothing streams after all
        stage_bytes = slot_bytes if tier_wide_rows is not None and backend == "cuda" else 0
        avail += device_slots_total - stage_bytes
        device_slots_total = stage_bytes
    rest = [i for i in rest if tiers[i] != CPU]
    layers_ram_budget = ram_left - cpu_held  # what pinned copies and host slots may take
    host_slots_total = 0
    rest_bytes = sum(index.layers[i].image_bytes for i in rest)
    if rest_bytes <= layers_ram_budget:
        for i in rest:
            tiers[i] = RAM
    else:
        host_slots_total = cfg.ring_slots * slot_bytes
        ram_avail = layers_ram_budget - host_slots_total
        used = 0
        for i in rest:
            if used + index.layers[i].image_bytes > ram_avail:
                break
            tiers[i] = RAM
            used += index.layers[i].image_bytes

    ram_used = host_slots_total + sum(index.layers[i].image_bytes for i in kept if tiers[i] == RAM)
    standby: list[int] = []
    standby_bytes = 0
    if any(tiers[i] in (RAM, STORAGE) for i in kept):  # only where dma runs: it holds the copies
        for i in demotion_order([i for i in kept if tiers[i] == VRAM]):
            if ram_used + standby_bytes + index.layers[i].image_bytes > layers_ram_budget:
                break
            standby.append(i)
            standby_bytes += index.layers[i].image_bytes

    def total(tier: str) -> int:
        return sum(index.layers[i].nbytes for i in range(n) if tiers[i] == tier)

    left = avail - sum(layer_costs[i] for i in kept if tiers[i] == VRAM)  # what the layers left
    kv_chunks = max(floor_chunks, min(want_chunks, floor_chunks + max(left, 0) // chunk_bytes))
    kv_max_chunks = max(kv_chunks, min(want_chunks, kv_chunks + sum(layer_costs[i] for i in standby) // chunk_bytes))
    need_pages = pages_for_positions(ctx)
    if need_pages > kv_max_chunks * chunk_pages:
        most = kv_max_chunks * chunk_pages * PAGE_TOKENS
        raise ConfigError(
            f"--ctx {ctx}: one sequence of {ctx} positions needs {format_bytes(need_pages * page_bytes)} of KV cache, and "
            f"this plan holds at most {most} positions ({format_bytes(kv_max_chunks * chunk_bytes)}) even with every "
            "standby layer demoted: lower --ctx, or raise --vram-budget (or --ram-budget, for standby copies)")

    return Plan(
        tiers=tuple(tiers), backend=backend, memory_name=costs.memory_name, n_slots=cfg.ring_slots, slot_bytes=slot_bytes,
        vram_budget=vram_budget, ram_budget=ram_budget, globals_bytes=globals_bytes,
        kv_bytes=kv_chunks * chunk_bytes, kv_tokens=kv_chunks * chunk_pages * PAGE_TOKENS, workspace_bytes=workspace,
        draft_bytes=draft_bytes,
        device_slot_bytes_total=device_slots_total, host_slot_bytes_total=host_slots_total,
        vram_layer_bytes=total(VRAM), ram_layer_bytes=total(RAM), storage_layer_bytes=total(STORAGE),
        skipped_layer_bytes=total(SKIPPED), standby_layers=tuple(standby), standby_bytes=standby_bytes,
        ctx=ctx, kv_page_bytes=page_bytes, kv_chunk_pages=chunk_pages, kv_chunks=kv_chunks, kv_max_chunks=kv_max_chunks,
        kv_floor_tokens=floor_tokens, speed_notes=tuple(speed_notes),
        max_pass_rows=cfg.largest_pass_rows if backend == "cuda" else 0,
        cpu_layer_bytes=total(CPU), cpu_held_bytes=cpu_held,
        link_gbps=rates.link_gbps if rates else 0.0, cpu_gbps=rates.cpu_gbps if rates else 0.0,
        mem_gbps=rates.mem_gbps if rates else 0.0, rates_how=rates.how if rates else "",
        cpu_beside_link_gbps=rates.cpu_beside_link_gbps if rates else 0.0,
        link_beside_cpu_gbps=rates.link_beside_cpu_gbps if rates else 0.0,
        gpu_gbps=rates.gpu_gbps if rates else 0.0,
        embed_in_host=embed_in_host, embed_host_bytes=costs.host_globals_bytes if embed_in_host else 0,
        tier_wide_rows=tier_wide_rows,
    )


def _cpu_layers(index: ModelIndex, cfg: InstanceConfig, rest: list[int], rates: HostRates | None,
                host_layer_bytes: tuple[int, ...] | None, ram_budget: int, resident_bytes: int) -> tuple[list[int], int]:
    """The cpu tier's layers among ``rest`` (those not resident; ``resident_bytes`` the resident
    ones' file bytes, which the GPU computes in the same chain) and the host RAM they hold:
    ``cfg.cpu_layers`` of them, or (auto) ``cpu_split``'s count by ``rates`` on cuda, spread
    evenly among ``rest`` so that they alternate with streamed ones. Auto holds fewer where the
    RAM budget would not hold them; a count the user gave that does not fit is an error."""
    held = host_layer_bytes or tuple(layer.nbytes for layer in index.layers)
    if cfg.cpu_tier_barred is not None:  # an explicit count is refused by InstanceConfig.validate
        count = 0
    elif cfg.cpu_layers is not None:
        count = min(cfg.cpu_layers, len(rest))
    elif rates is not None and cfg.backend == "cuda" and rest:
        count = cpu_split([index.layers[i].nbytes for i in rest], rates, resident_bytes)
    else:
        count = 0
    chosen = spread_pick(rest, count)
    if cfg.cpu_layers is not None and sum(held[i] for i in chosen) > ram_budget:
        raise ConfigError(f"--cpu-layers {cfg.cpu_layers}: those layers take {format_bytes(sum(held[i] for i in chosen))} "
                          f"of host RAM and --ram-budget is {format_bytes(ram_budget)}: fewer layers, or a larger budget")
    while chosen and sum(held[i] for i in chosen) > ram_budget:
        count -= 1
        chosen = spread_pick(rest, count)
    return chosen, sum(held[i] for i in chosen)
