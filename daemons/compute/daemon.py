"""The compute daemon: the engine core wrapped in a process, fed by the device ring.

It owns the resident layers, the device slots (shared memory on the cpu backend, device buffers
shared through CUDA IPC on cuda), the KV caches and the scheduler. Requests arrive from the
supervisor on the control channel as token ids (``EngineRequest``) and the engine's outputs go
back the same way (``EngineOutputs``); the supervisor keeps the client connections and the text
side (the tokenizer, chat template, stop strings), so a crash of this process still ends in an
error reply for every client.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import zmq

from ntx.daemons.compute.engine import EngineCore
from ntx.daemons.compute.factory import backend_for, build_engine, warm_up_engine
from ntx.daemons.compute.residency import Residency
from ntx.daemons.compute.ring_stream import RingStream
from ntx.shared import messages as m
from ntx.shared.config import InstanceConfig
from ntx.shared.daemon import Daemon, daemon_main
from ntx.shared.gguf_index import open_model
from ntx.shared.plan import CPU, VRAM, Plan
from ntx.shared.stats import StageClock


class ComputeDaemon(Daemon):
    name = "compute"

    def setup(self, config: m.Config) -> m.Ready:
        cfg = InstanceConfig.from_dict(config.instance)
        self.cfg = cfg
        self.index = open_model(cfg.model)
        self.plan = Plan.from_dict(config.plan)
        self.backend = backend_for(cfg.backend, self.index, cfg, self.plan)
        self.clock = StageClock("compute")
        streamed = self.plan.streamed_layers
        descriptors: list[Any] = []
        stream = None
        if streamed:
            # the device slots the dma daemon fills: shared memory on cpu, CUDA IPC on cuda
            slot_bufs, descriptors = self.backend.alloc_slots(self.plan.n_slots, self.plan.slot_bytes,
                                                              config.shm_names["dev_slot"])
            self.ring = self.ctx.socket(zmq.PAIR)
            self.ring.setsockopt(zmq.LINGER, 0)
            self.ring.bind(config.device_ring)
            stream = RingStream(
                self.ring, slot_bufs, streamed, {i: layer.nbytes for i, layer in enumerate(self.index.layers)},
                self.clock, on_wait=self._on_wait, before_release=self.backend.sync,
            )
        # the plan's skipped layers are cfg.skip_layers (make_plan)
        t0 = time.monotonic()
        host_layers = self.plan.layers_on(CPU)
        self.engine: EngineCore = build_engine(self.index, self.backend, cfg, resident_layers=self.plan.layers_on(VRAM),
                                               stream=stream, host_layers=host_layers,
                                               host_wide_rows=self.plan.tier_wide_rows,
                                               host_rates=self.plan.host_rates, warm_up=False)
        loaded = self.plan.layers_on(VRAM) + host_layers
        loaded_bytes = sum(self.index.layers[i].nbytes for i in loaded)
        load_s = time.monotonic() - t0
        self.say(f"{len(self.plan.layers_on(VRAM))} resident layers, {len(host_layers)} on the host CPU "
                 f"({loaded_bytes / 2**30:.2f} GiB in all) and the globals loaded in {load_s:.2f} s "
                 f"({(loaded_bytes + self.index.global_bytes_total) / max(load_s, 1e-9) / 1e9:.2f} GB/s); "
                 f"KV pool {self.backend.kv_stats().pages_total} pages")
        if stream is not None and self.plan.standby_layers:  # the KV cache may take resident layers' memory
            drafter = self.engine.drafter
            costs = self.backend.memory_costs(self.index, max_seqs=1, max_ctx=1, max_pass_rows=1)
            self.engine.kv_room = Residency(self.engine.model, list(self.plan.standby_layers), costs.layer_bytes,
                                            keep=frozenset(getattr(drafter, "layers", ())))
        # before ready: no request pays for compiling kernels or recording graphs
        self.warm_up_s = warm_up_engine(self.engine, self.say)
        self.active = False
        self.draining_until_s: float | None = None
        self.recent_tokens: deque[tuple[float, int]] = deque()
        self.longest_step_s = 0.0  # the longest engine step since ready: the supervisor's liveness allows for it
        return m.Ready(device_slots=descriptors)

    def ready_note(self) -> str:
        return f" ({self.warm_up_s:.2f} s of it warm-up)"

    # -- control ------------------------------------------------------------------------------
    def handle_control(self, msg: m.Message) -> None:
        if isinstance(msg, m.EngineRequest):
            self.submit(msg)
        elif isinstance(msg, m.Cancel):
            self.send_events(self.engine.cancel(msg.rid))
        elif isinstance(msg, m.Drain):
            self.draining_until_s = time.monotonic() + msg.timeout_s

    def submit(self, req: m.EngineRequest) -> None:
        """Queue a request from the front (checked there); one the engine cannot hold anyway is
        answered with its error, never raised."""
        try:
            self.engine.submit(req)
        except m.RequestError as e:
            self.send_events([m.EngineError(id=req.id, code=e.code, message=str(e))])

    def send_events(self, events: list[m.EngineEvent]) -> None:
        if events:
            self.send_control(m.EngineOutputs(events=events))

    def _on_wait(self) -> None:
        """Between the slices of a ring wait: report, and give up once the daemon must stop."""
        self.check_stop()
        self.maybe_send_stats()

    def _set_active(self, active: bool) -> None:
        if active != self.active:
            self.active = active
            if self.plan.streamed_layers:
                self.send(self.ring, m.Activity(active=active))
            self.clock.enter("busy" if active else "idle")

    # -- the loop -----------------------------------------------------------------------------
    def serve(self) -> None:
        while not self.stopping:
            timeout_ms = 0 if self.engine.has_work else int(m.STATS_INTERVAL_S * 1000)
            if self.control.poll(timeout_ms):
                self.poll_control()
            if self.draining_until_s is not None:
                if not self.engine.has_work or time.monotonic() > self.draining_until_s:
                    self.send_events(self.engine.cancel_all("cancelled"))
                    self.send_control(m.Drained())
                    self.draining_until_s = None
            if self.engine.has_work:
                self._set_active(True)
                # the step's time is its pass's, whether or not a layer streams (the ring stream
                # enters its states for the pass too, as it waits for a layer and gets it)
                self.clock.enter("busy", self.engine.pass_taken_next)
                n_before = self.engine.tokens_generated
                t0 = time.monotonic()
                events = self.engine.step()
                self.longest_step_s = max(self.longest_step_s, time.monotonic() - t0)  # liveness allows for it
                self.send_events(events)
                if self.engine.last_pass is not None:
                    self.clock.add_rows(*self.engine.last_pass)
                    self.engine.last_pass = None
                self.recent_tokens.append((time.monotonic(), self.engine.tokens_generated - n_before))
            if not self.engine.has_work:  # at once, or the wait for the next message counts as the last pass's
                self._set_active(False)
            self.maybe_send_stats()

    def stats(self) -> dict[str, Any]:
        snap = self.clock.snapshot()
        now = time.monotonic()
        while self.recent_tokens and now - self.recent_tokens[0][0] > 5.0:
            self.recent_tokens.popleft()
        window = sum(n for _, n in self.recent_tokens)
        span = (now - self.recent_tokens[0][0]) if len(self.recent_tokens) > 1 else 0.0
        snap.update(
            active=self.engine.active_ids, queued=self.engine.queued_ids,
            tokens_generated=self.engine.tokens_generated, n_passes=self.engine.model.next_pass_id,
            tokens_per_s=round(window / span, 3) if span > 0 else 0.0, kv=self.engine.kv_report(),
            longest_step_s=round(self.longest_step_s, 3),
        )
        host = self.engine.model.host
        if host is not None:  # the cpu tier's share of compute's time (its layers run inside compute's passes)
            snap["cpu_tier"] = host.report()
        if self.engine.drafter is not None:
            depth, width = self.engine.shape.best()
            snap["speculation"] = {"drafter": self.engine.drafter.name, "draft_tokens": self.engine.draft_tokens,
                                   "tree_depth": depth, "tree_width": width, **self.engine.spec.report(),
                                   "probes": self.engine.probes, "probes_accepted": self.engine.probes_accepted,
                                   "trees_cut": self.engine.trees_cut, **self.engine.drafter.report()}
        return snap

    def close(self) -> None:
        if hasattr(self, "engine"):
            self.engine.cancel_all()
        self.engine = None
        if hasattr(self, "ring"):
            self.ring.close(linger=0)
        if hasattr(self, "backend"):
            self.backend.close()


if __name__ == "__main__":
    daemon_main(ComputeDaemon)
