"""``ntxctl status`` as a person reads it: plan, stages (busy / starved / blocked, GB/s), the
bottleneck, slots, requests and daemons."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ntx.shared.config import InstancePaths, format_bytes
from ntx.shared.plan import layer_ranges
from ntx.shared.stats import window


def _pct(x: float | None) -> str:
    return f"{100 * (x or 0):5.1f}%"


def _slots_line(sl: dict[str, Any]) -> str:
    """The ring slots in words: ``host`` is dma's count of host slots per state (absent when no
    layer streams from storage), ``device_free_at_dma`` the device slots dma holds free."""
    line = f"slots: {sl['n_slots']} × {format_bytes(sl['slot_bytes'])} per side"
    host = sl.get("host")
    if host:
        line += "; host slots " + ", ".join(f"{n} {state}" for state, n in host.items())
    if sl.get("device_free_at_dma") is not None:
        line += f"; device slots free at dma: {sl['device_free_at_dma']}"
    return line


def kv_line(kv: dict[str, Any]) -> str:
    """The KV cache in one line: pages in use, cached and free, the prefix cache's hits, what was
    preempted and which layers are demoted for it."""
    pt = kv["page_tokens"]
    looked = kv["prefix_hit_tokens"] + kv["prefix_miss_tokens"]
    line = (f"KV cache: {kv['pages_in_use']} of {kv['pages_total']} pages in use ({kv['pages_in_use'] * pt} positions), "
            f"{kv['pages_cached']} cached, {kv['pages_free']} free; prefix reuse {kv['prefix_hit_tokens']} of {looked} "
            f"prompt tokens")
    if kv.get("paused"):
        line += f"; {kv['paused']} sequences waiting for pages"
    if kv.get("preemptions"):
        line += f"; {kv['preemptions']} preempted so far"
    if kv.get("demoted_layers"):
        line += f"; layers demoted for it: {layer_ranges(sorted(kv['demoted_layers']))}"
    return line


def last_done_pass(stage: dict[str, Any]) -> str | None:
    """The newest pass a stage has finished (its key in ``passes``): the newest of all once the
    stage is idle, else the one before it (the newest may still be running, as ``recent`` says)."""
    keys = sorted(stage.get("passes") or (), key=int)
    if stage.get("state") != "idle":
        keys = keys[:-1]
    return keys[-1] if keys else None


def render_status(st: dict[str, Any], renderable: bool = False):
    head = Text()
    head.append(f"instance {st['instance']}  ", style="bold")
    state_style = {"ready": "green", "starting": "yellow", "restarting": "yellow", "stopping": "yellow"}.get(st["state"], "red")
    head.append(st["state"], style=state_style)
    head.append(f"  gen {st['gen']}  restarts {st['restarts']}  up {st['uptime_s']:.0f}s  {st['backend']}  {st['listen']}\n")
    head.append(f"model {st['model']}\n")
    for name in st.get("stalled") or ():
        head.append(f"{name} is stalled: no stats for {st['daemons'][name]['silent_s']:.1f} s "
                    "(restarted after --stall-timeout)\n", style="red")
    if st.get("kernels"):
        head.append(f"kernels {st['kernels']}\n")
    if st.get("http"):
        head.append(f"http  http://{st['http']}/v1 (OpenAI API) · status page http://{st['http']}/\n")
    head.append(f"logs  {st.get('log_dir') or InstancePaths(st['instance']).log_dir}\n")
    if st.get("reason"):
        head.append(f"reason: {st['reason']}\n", style="red")
    plan = Text("tier plan\n", style="bold")
    for line in st["plan"]["lines"]:
        plan.append(f"  {line}\n")

    # compact (no vertical rules) so that every figure stays readable in an 80-column terminal
    stages_title = Text("stages: share of active time over the recent passes (all time before any)", style="bold")
    stages = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, show_edge=False)
    for col in ("stage", "now", "passes", "busy", "starved", "blocked", "GB/s", "avg", "limit"):
        stages.add_column(col, justify="right" if col not in ("stage", "now") else "left", no_wrap=True)
    passes = Text()
    for name in ("reader", "dma", "compute"):
        s = st["stages"].get(name)
        if not s:
            continue
        t = window(s)
        k = last_done_pass(s)
        if k is not None:
            p = s["passes"][k]
            passes.append(f"  {name} last complete pass #{k}: {p['busy']:.3f}s busy, {p['starved']:.3f}s starved, "
                          f"{p['blocked']:.3f}s blocked, {format_bytes(p['bytes'])}\n")
        mark = " ◀" if st.get("bottleneck") == name else ""
        limit = s.get("limit_gbps")
        stages.add_row(name + mark, s.get("state", ""), str(t.get("n_passes", "all")), _pct(t["busy_share"]),
                       _pct(t["starved_share"]), _pct(t["blocked_share"]),
                       f"{t['busy_gbps']:.2f}", f"{t['active_gbps']:.2f}", f"{limit:.2f}" if limit else "")
    tier = (st["stages"].get("compute") or {}).get("cpu_tier")
    if tier:  # the cpu tier's layers run inside compute's passes: its share is of compute's busy time
        compute_busy_s = st["stages"]["compute"]["total"]["busy"]
        stages.add_row("  cpu tier", f"{tier['layers']} layers", "", _pct(tier["busy_s"] / compute_busy_s if compute_busy_s
                                                                        else 0.0),
                       "", "", f"{tier['busy_gbps']:.2f}", "", "")
        shares = tier.get("streamed_by_rows") or {}
        passes.append(f"  cpu tier: {tier['recent_pass_s'] * 1e3:.1f} ms of each recent pass on {tier['threads']} host "
                      f"threads, {format_bytes(tier['bytes_per_pass'])} of weights read in place"
                      + (f"; of its {tier['layers']} layers, passes stream "
                         + ", ".join(f"{n} at up to {rows} rows" for rows, n in shares.items()) if shares else "")
                      + "\n")
    legend = Text("  GB/s: while busy · avg: over active time · limit: link speed dma measured"
                  + (" · cpu tier: its share of compute's busy time, GB/s of weights the host's cores read"
                     if tier else "") + "\n", style="dim")

    tail = Text()
    if st.get("bottleneck"):
        what = {"reader": "storage reads", "dma": "host-to-device copies (H2D)", "compute": "compute"}.get(st["bottleneck"], "")
        tail.append(f"bottleneck: {st['bottleneck']} — {what} (◀: the stage that waits least)\n", style="bold")
    r = st["requests"]
    tail.append(f"requests: {r['active']} active, {r['queued']} queued, {r['in_flight']} in flight;  "
                f"{st['tokens_per_s']:.2f} tok/s, {st['tokens_generated']} tokens so far\n")
    spec = st.get("speculation")
    if spec:
        tail.append(f"speculation: {spec['drafter']} drafter, trees of {spec['draft_tokens']} tokens at most "
                    f"(now depth {spec['tree_depth']}, width {spec['tree_width']}); drafted "
                    f"{spec['drafted']}, accepted {spec['accepted']} ({spec['acceptance_rate']:.0%}); "
                    f"mean acceptance length {spec['accepted_per_pass']:.2f} over {spec['verify_passes']} verify passes"
                    + (f"; {spec['trees_cut']} trees cut beside prompt chunks" if spec.get("trees_cut") else "") + "\n")
    kv = st.get("kv")
    if kv:
        tail.append(kv_line(kv) + "\n")
        for event in kv.get("residency_events", [])[:3]:
            tail.append(f"  {event}\n", style="dim")
    tail.append(_slots_line(st["slots"]) + "\n")
    io = st.get("io") or {}
    if io.get("io_mode"):
        tail.append(f"storage reads: {io['io_mode']}" + (f" (fallback: {io['io_fallback']})" if io.get("io_fallback") else "") + "\n")
    daemons = Table(title="daemons", title_justify="left")
    for col in ("daemon", "pid", "state", "uptime", "restarts"):
        daemons.add_column(col)
    for n, d in st["daemons"].items():
        daemons.add_row(n, str(d["pid"]), d["state"], f"{d['uptime_s']:.0f}s", str(d["restarts"]))
    group = Group(head, plan, stages_title, stages, legend, passes, tail, daemons)
    if renderable:
        return group
    Console().print(group)
    return None
