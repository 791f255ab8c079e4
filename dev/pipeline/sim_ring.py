"""One streamed pass through the device ring, simulated layer by layer: why part of the cpu tier
in passes of a few rows ran slower than streaming it whole (docs/PERFORMANCE.md, "Part of the
tier in passes of a few rows"), and what it would take.

The model (``ntx.shared.plan.ring_pass_s``, which the engine's share now chooses by, with
``NTX_TIER_SHARE=on``; this tool replays a bench file's run through it):
  - the layers run in order, one at a time: a resident layer on the GPU (``gpu_ms``), a
    cpu-tier layer kept on the host on the cores (``host_ms``), a streamed one on the GPU once
    its copy has landed (``gpu_ms`` after it);
  - the link copies the streamed layers in order (``copy_ms`` each), each into one of ``slots``
    device slots, and a slot is free again when the GPU has run the layer it held.
What ``HostRates.pass_s`` leaves out is the slots: while the cores compute a layer of 8 rows
(25 ms on the H200's host), the link fills the two slots in 18.6 ms and then waits.

    python dev/pipeline/sim_ring.py docs/results/bench-70b-tier-share-learnt-b8-h200.json 7

replays a bench file's plan (the share of ``k`` tier layers streamed, as the run had it) and
prints the predicted pass beside the measured one, then every share at 2-4 slots.
"""

from __future__ import annotations

import json
import sys

from ntx.shared.plan import GPU, STREAMED, TIER, ring_pass_s, spread_pick


def pass_ms(tiers: list[str], moved: set[int], slots: int, host_ms: float, gpu_ms: float, copy_ms: float) -> float:
    """One pass's time (``plan.ring_pass_s``) with every layer alike: ``tiers`` per layer
    ("vram", "cpu", "ram", "storage", "skipped"), the cpu-tier layers in ``moved`` streamed with
    the others, the rest of the tier on the host."""
    kinds, run_ms = [], []
    for i, t in enumerate(tiers):
        if t == "skipped":
            continue
        kind = GPU if t == "vram" else TIER if t == "cpu" and i not in moved else STREAMED
        kinds.append(kind)
        run_ms.append(host_ms if kind == TIER else gpu_ms)
    return ring_pass_s(kinds, run_ms, [copy_ms] * len(kinds), slots)


def main(path: str, k: int) -> None:
    scenario = json.load(open(path))["scenarios"][0]
    tiers = scenario["status"]["plan"]["tiers"]
    cpu = [i for i, t in enumerate(tiers) if t == "cpu"]
    tier = scenario["cpu_tier"]
    link_gbps = scenario["host_rates"]["link_beside_cpu_gbps"] or scenario["host_rates"]["link_gbps"]
    layer_gb = tier["bytes_per_pass"] / len(cpu) / 1e9
    copy_ms = layer_gb / link_gbps * 1e3
    host_ms = tier["recent_pass_s"] * 1e3 / max(1, len(cpu) - k) if k < len(cpu) else 0.0
    gpu_ms = 0.7  # the 70B's layer at 8 rows on the H200 (compute busy ~57 ms a pass of 80)
    moved = set(spread_pick(cpu, k))
    print(f"{path}: {len(cpu)} tier layers, {k} streamed; copy {copy_ms:.1f} ms, host {host_ms:.1f} ms a layer")
    print(f"  predicted {pass_ms(tiers, moved, 2, host_ms, gpu_ms, copy_ms):.1f} ms a pass at 2 slots, "
          f"measured {scenario['pass_s'] * 1e3:.1f}; the whole tier streamed: "
          f"{pass_ms(tiers, set(cpu), 2, host_ms, gpu_ms, copy_ms):.1f}")
    for slots in (2, 3, 4):
        best = min((pass_ms(tiers, set(spread_pick(cpu, n)), slots, host_ms, gpu_ms, copy_ms), n)
                   for n in range(len(cpu) + 1))
        print(f"  {slots} slots: the best share streams {best[1]} of {len(cpu)}: {best[0]:.1f} ms "
              "(each slot past two costs a resident layer, not counted here)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
