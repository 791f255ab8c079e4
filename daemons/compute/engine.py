"""The engine core: token ids in, one pass per ``step()``, token ids out. No sockets, no text.

Following vLLM's split of ``EngineCore`` from its process wrapper, this is the plain loop that
``ntxctl generate --local`` runs in-process and that the compute daemon wraps with ZeroMQ. Each
``step()`` is one pass over the layers that advances every admitted sequence: decoding sequences
by one token (or a verified draft), prefilling ones by a chunk of their prompt (continuous
batching: a request joins at the next pass and leaves when it is done, freeing its KV cache).

Requests are ``messages.EngineRequest`` records (prompt token ids, sampling parameters,
log-probability counts); events are ``messages.EngineOutput`` (a request's new token ids and
their log-probabilities, its finish) and ``messages.EngineError`` records. Chat templates,
tokenizing, detokenizing, stop strings and everything a client reads as text are the front's
(ctl/requests.py, in the supervisor); the engine knows the model's stop token ids.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import numpy as np

from ntx.daemons.compute.backend import PendingPicks, Pick, Picked, log_normaliser, ranked_of
from ntx.daemons.compute.batch import SeqChunk, StepBatch
from ntx.daemons.compute.kv_pages import KvPoolExhausted
from ntx.daemons.compute.model import LlamaModel
from ntx.daemons.compute.sampler import NumericalError, Sampler, logprobs_topk
from ntx.daemons.compute.speculation import Acceptance, Drafter, DraftRequest, DraftTree, TreeShape, verify_tree
from ntx.shared.config import largest_pass_rows
from ntx.shared.errors import NtxError
from ntx.shared.kv_sizing import PAGE_TOKENS
from ntx.shared.messages import (EngineError, EngineEvent, EngineOutput, EngineRequest, RequestError, SpecCounts,
                                 check_prompt_tokens)


class KvRoom(Protocol):
    """Where more KV pages come from when the pool runs out (``model.Residency``: resident layers
    demoted to streamed, their memory turned into pages)."""

    def make_room(self, n_pages: int) -> int:
        """Add at least ``n_pages`` pages if it can; returns the pages added (0: none now)."""

    def may_grow(self) -> bool:
        """Whether pages may still come later without any sequence ending."""

    def maybe_promote(self, busy: bool) -> bool:
        """Between passes: give memory back to a layer if the pool has long had plenty (``busy``:
        somebody waits for pages). Whether it did."""


@dataclass
class _Seq:
    """A request in flight: its KV cache (``seq_id``), progress, and what it sent so far."""

    req: EngineRequest
    seq_id: int
    sampler: Sampler
    t_submit_s: float
    n_prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    prompt_lp: list[Any] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed through the model
    t_first_token_s: float = 0.0
    t_admit_s: float = 0.0
    draft: DraftTree | None = None  # proposed, verified by the next pass
    shadow: DraftTree | None = None  # a shadow probe: one token proposed beside the next (undrafted) pass
    started: bool = False  # an output was sent (prompt_logprobs go with the first)
    # the tokens whose keys and values a prefill writes: the prompt, or after a preemption the
    # prompt and every generated token but the last (resumed: nothing is sampled at their end)
    prefill_tokens: list[int] = field(default_factory=list)
    resumed: bool = False
    committed_pages: int = 0  # full pages of written tokens handed to the prefix cache so far
    paused: bool = False  # no page for what it writes next: sits out this pass
    acceptance: Acceptance | None = None  # how its drafts fared (speculation): its own tree shape

    @property
    def prefilling(self) -> bool:
        return self.n_prefilled < len(self.prefill_tokens)

    @property
    def n_written(self) -> int:
        """Positions whose keys and values are written: the prefilled ones, or when decoding all
        but the last generated token's (fed by the next pass)."""
        return self.n_prefilled if self.prefilling else len(self.req.prompt_tokens) + len(self.generated) - 1


@dataclass
class _Ahead:
    """A greedy decode pass queued before the host had seen the tokens it decodes from: fed, on
    the device, the top-1 ids of the pass before it (``LlamaModel.launch`` with ``feed``)."""

    pending: PendingPicks
    batch: StepBatch
    seqs: list[_Seq]
    last_pass: tuple[int, int, int]  # EngineCore.last_pass once it is taken


class EngineCore:
    """Requests in, one pass per ``step()``, events out (the module's docstring says how).

    ``stop_token_ids``: the model's end-of-generation tokens (``shared.vocab``); drawing one ends a
    request with ``stop`` and the token is not output.

    ``run_ahead`` (default: where the backend queues passes, ``Backend.queues_passes``): while
    every running sequence decodes greedily, alone on its row, step() queues the next pass, fed
    the current pass's top-1 tokens on the device, before it waits for the current one, so the
    GPU never idles while the host samples and sends. Tokens are the same either
    way: a greedy row's token is its top-1; a pass queued for a sequence that then stops is
    thrown away (its KV entry lies beyond the sequence's end, rewritten before it is ever read)."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        stop_token_ids: Iterable[int] = (),
        kv_room: KvRoom | None = None,
        max_batch: int = 16,
        prefill_chunk_tokens: int = 512,
        max_context: int | None = None,
        drafter: Drafter | None = None,
        draft_tokens: int = 4,
        draft_width: int | None = None,
        draft_fixed: bool = False,
        run_ahead: bool | None = None,
    ) -> None:
        self.model = model
        self.run_ahead = model.backend.queues_passes if run_ahead is None else run_ahead
        self._ahead: _Ahead | None = None
        self.passes_fed = 0  # passes queued ahead, fed on the device (run_ahead)
        self.drafter = drafter
        self.draft_tokens = draft_tokens
        self.shape = TreeShape(draft_tokens, draft_width, draft_fixed)  # None: the width is chosen as it measures
        self.spec = SpecCounts()  # over every request
        self.probes = self.probes_accepted = 0  # shadow probes (TreeShape.shadow_probe) since start
        self.trees_cut = 0  # draft trees cut short or left out for the rows a prompt chunk took, since start
        self.stop_token_ids = frozenset(stop_token_ids)
        self.kv_room = kv_room  # more KV pages when the pool runs out (demoted layers); None: none
        self.preemptions = 0  # sequences sent back to the queue for want of KV pages
        self.max_batch = max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # the most rows a pass takes (what the warm-up records and the planner reserves): a prompt
        # chunk beside the other sequences' decode rows, or every sequence with its draft; the
        # drafts of a pass that carries a prompt chunk take only what the chunk leaves
        self.max_pass_rows = largest_pass_rows(prefill_chunk_tokens, max_batch,
                                               draft_tokens if drafter is not None else 0)
        self.max_context = min(max_context or model.hp.n_ctx_train, model.hp.n_ctx_train)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._ids: set[str] = set()
        self._seq_ids = itertools.count()
        self.last_pass: tuple[int, int, int] | None = None
        self.tokens_generated = 0

    # -- admission -----------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        """Queue a request; raises RequestError (nothing queued) if it cannot be held: an id in
        flight, a prompt the model or the context cannot take (``check_prompt_tokens``: the
        front checked it for a client already, so this is the engine's own guard), sampling
        parameters the sampler refuses."""
        if req.id in self._ids:
            raise RequestError("duplicate_id", f"request id {req.id!r} is already in flight")
        check_prompt_tokens(req.prompt_tokens, self.model.hp.n_vocab, self.max_context)
        try:
            sampler = Sampler(req.params)
        except NtxError as e:
            raise RequestError("bad_request", str(e)) from None
        self._ids.add(req.id)
        self.waiting.append(_Seq(req, -1, sampler, time.monotonic(), prefill_tokens=list(req.prompt_tokens)))

    def cancel(self, req_id: str) -> list[EngineEvent]:
        """Stop a request; returns its last output (finish_reason ``cancelled``), or [] when it is
        not in flight."""
        for seqs in (self.waiting, self.running):
            for s in list(seqs):
                if s.req.id == req_id:
                    seqs.remove(s)
                    return [self._finish(s, "cancelled")]
        return []

    def cancel_all(self, reason: str = "cancelled") -> list[EngineEvent]:
        self._drop_ahead()
        out = [self._finish(s, reason) for s in list(self.running) + list(self.waiting)]
        self.running.clear()
        self.waiting.clear()
        return out

    @property
    def has_work(self) -> bool:
        """Requests to serve, or a queued pass to take back (one more step)."""
        return bool(self.waiting or self.running or self._ahead)

    def kv_report(self) -> dict[str, Any]:
        """The KV cache for status: pages (total, in use, cached, free) and positions, the prefix
        cache's hits, preemptions, and the layers demoted for it."""
        st = self.model.backend.kv_stats()
        out = {
            "page_tokens": st.page_tokens, "pages_total": st.pages_total, "pages_in_use": st.pages_in_use,
            "pages_cached": st.pages_cached, "pages_free": st.pages_free, "chunks": st.chunks,
            "sequences": st.sequences, "prefix_lookups": st.prefix_lookups, "prefix_hit_tokens": st.prefix_hit_tokens,
            "prefix_miss_tokens": st.prefix_miss_tokens, "evictions": st.evictions, "preemptions": self.preemptions,
            "paused": sum(1 for s in self.running if s.paused),
        }
        log = getattr(self.kv_room, "log", None)
        if log is not None:
            out["demoted_layers"] = list(log.demoted)
            out["residency_events"] = list(log.events[:5])
        return out

    @property
    def active_ids(self) -> list[str]:
        return [s.req.id for s in self.running]

    @property
    def queued_ids(self) -> list[str]:
        return [s.req.id for s in self.waiting]

    # -- one pass ------------------------------------------------------------------------------
    def _admit(self) -> list[EngineEvent]:
        """Admit waiting requests in order while there are rows and KV pages for their prompts
        (a prefix already cached is reused: prefill starts after it). A request the pool cannot
        hold waits, and while one waits or a running sequence is paused for pages nobody behind
        it is admitted; one the pool can never hold fails (``context_overflow``)."""
        be = self.model.backend
        events: list[EngineEvent] = []
        while self.waiting and len(self.running) < self.max_batch and not any(s.paused for s in self.running):
            s = self.waiting[0]
            seq_id = next(self._seq_ids)
            reuse = not s.req.prompt_logprobs  # a scored prompt needs every row's logits
            try:
                reused = be.open_sequence(seq_id, s.prefill_tokens, len(s.prefill_tokens), reuse)
            except KvPoolExhausted as e:
                if self._make_room(e.needed_pages - e.available_pages):
                    continue
                if not self.running and not self._room_may_come():
                    self.waiting.popleft()
                    self._ids.discard(s.req.id)
                    events.append(EngineError(id=s.req.id, code="context_overflow", message=str(e)))
                    continue
                break  # it waits for pages: sequences end, or standby layers arrive
            self.waiting.popleft()
            s.seq_id, s.n_prefilled, s.committed_pages = seq_id, reused, reused // PAGE_TOKENS
            s.t_admit_s = s.t_admit_s or time.monotonic()
            self.running.append(s)
        return events

    def _make_room(self, n_pages: int) -> bool:
        """Ask for ``n_pages`` more pages (``kv_room``: a resident layer demoted); whether any came."""
        return self.kv_room is not None and self.kv_room.make_room(max(n_pages, 1)) > 0

    def _room_may_come(self) -> bool:
        """Whether pages may come later without any sequence ending (standby copies still loading)."""
        return self.kv_room is not None and self.kv_room.may_grow()

    def _grow(self) -> list[EngineEvent]:
        """Pages for the position each decoding sequence writes this pass. Short of pages: room
        is made (``kv_room``); else the sequences left without a page sit this pass out, and if
        none could run at all the newest is preempted (its pages go back, it waits at the head
        of the queue and resumes by recomputing its keys and values). A lone sequence the pool
        can never hold fails with ``context_overflow``."""
        be = self.model.backend
        events: list[EngineEvent] = []
        while True:
            for s in self.running:
                s.paused = False
            short = [s for s in self.running if not s.prefilling and not be.grow_sequence(s.seq_id, s.n_written + 1)]
            if not short:
                return events
            if self._make_room(len(short)):
                continue
            if len(short) < len(self.running):
                for s in short:
                    s.paused = True
                return events
            if len(self.running) == 1:
                if self._room_may_come():
                    short[0].paused = True
                    return events
                s = self.running[0]
                events.append(self._fail(s, "context_overflow",
                                         f"KV page pool exhausted: this sequence needs {s.n_written + 1} positions and "
                                         f"the instance holds at most {be.kv_pool.pages_total * PAGE_TOKENS}"))
                return events
            self._preempt(self.running[-1])

    def _preempt(self, s: _Seq) -> None:
        """Send the newest running sequence back to the head of the queue: its committed pages stay
        cached (its resumption most likely reuses them), the rest go back to the pool."""
        self._commit(s)
        self.running.remove(s)
        self.model.backend.free_sequence(s.seq_id)
        if self.drafter is not None:
            self.drafter.forget(s.seq_id)
        s.seq_id, s.n_prefilled, s.draft, s.paused, s.committed_pages = -1, 0, None, False, 0
        s.prefill_tokens = s.req.prompt_tokens + s.generated[:-1]
        s.resumed = True
        self.waiting.appendleft(s)
        self.preemptions += 1

    def _commit(self, s: _Seq) -> None:
        """Hand the pages of ``s`` that its written tokens filled since the last time to the prefix
        cache (only at page boundaries: most passes commit nothing)."""
        n = s.n_written
        if n // PAGE_TOKENS > s.committed_pages:
            tokens = s.prefill_tokens[:n] if s.prefilling else (s.req.prompt_tokens + s.generated)[:n]
            self.model.backend.commit_sequence(s.seq_id, tokens)
            s.committed_pages = n // PAGE_TOKENS

    def _prompt_rows(self) -> dict[int, int]:
        """How many prompt tokens each prefilling sequence takes in the next pass (by ``id``):
        in order, until the pass's prompt chunk (``prefill_chunk_tokens``) is spent."""
        out, budget = {}, self.prefill_chunk_tokens
        for s in self.running:
            if s.paused or not s.prefilling or budget <= 0:
                continue
            out[id(s)] = min(budget, len(s.prefill_tokens) - s.n_prefilled)
            budget -= out[id(s)]
        return out

    def _plan(self, prompt_rows: dict[int, int]) -> tuple[StepBatch, list[_Seq]]:
        """The pass: each prefilling sequence's chunk of ``prompt_rows`` (``_prompt_rows``), each
        decoding sequence's last token and tree."""
        chunks, seqs = [], []
        for s in self.running:
            if s.paused:
                continue
            if s.prefilling:
                if id(s) not in prompt_rows:
                    continue
                toks = s.prefill_tokens[s.n_prefilled : s.n_prefilled + prompt_rows[id(s)]]
                chunks.append(SeqChunk(s.seq_id, s.n_prefilled, tuple(toks),
                                       all_logits=s.req.prompt_logprobs > 0 and not s.resumed))
            else:  # the last token, then its draft tree if any (a chain needs no tree mask)
                pos = len(s.req.prompt_tokens) + len(s.generated) - 1
                if s.draft:
                    parents = None if s.draft.is_chain else s.draft.chunk_parents()
                    chunks.append(SeqChunk(s.seq_id, pos, (s.next_token, *s.draft.tokens), all_logits=True, parents=parents))
                else:
                    chunks.append(SeqChunk(s.seq_id, pos, (s.next_token,)))
            seqs.append(s)
        return StepBatch(chunks), seqs

    @property
    def pass_taken_next(self) -> int:
        """The pass whose rows the next step takes: the queued one (run ahead), else the one it
        runs. The compute daemon's clock charges the step's time to it."""
        return self._ahead.last_pass[0] if self._ahead is not None else self.model.next_pass_id

    def step(self) -> list[EngineEvent]:
        """Run one pass; return the events it produced (an output per request that gained tokens
        or ended, an error per request that failed)."""
        if self._ahead is not None:
            return self._step_ahead()
        if self.kv_room is not None:
            self.kv_room.maybe_promote(busy=bool(self.waiting) or any(s.paused for s in self.running))
        events = self._admit()
        events += self._grow()
        if not self.running:
            return events
        prompt_rows = self._prompt_rows()
        self._propose_drafts(sum(prompt_rows.values()))
        batch, seqs = self._plan(prompt_rows)
        if not seqs:  # every sequence waits for pages that may still come (standby copies loading)
            return events
        t0 = time.monotonic()
        try:
            pending = self.model.launch(batch, self._picks(batch, seqs))  # one per logit row
            # (pass id, token rows, prompt rows): lets the daemon's clock tell decode from prefill;
            # the id the pass ran as (a stream may have given up the one asked and run it as the next)
            last_pass = (self.model.next_pass_id - 1, batch.n_tokens,
                         sum(c.n_tokens for s, c in zip(seqs, batch.chunks) if s.prefilling))
            self._queue_ahead(pending, batch, seqs)
            picked = pending.result()
        except NtxError as e:
            # A layer of this pass never arrived: the sequences in it have half-written KV
            # caches, so they end with an error; everyone else goes on with the next pass.
            return events + [self._fail(s, "layer_unavailable", str(e)) for s in seqs]
        self.last_pass = last_pass
        if any(s.draft for s in seqs):
            self.shape.observe_times(verify_s=time.monotonic() - t0, rows=batch.n_tokens)
        elif self.drafter is not None and not last_pass[2]:  # a decode pass without drafts: what not drafting costs
            self.shape.observe_times(plain_s=time.monotonic() - t0)
        return events + self._take(batch, seqs, picked)

    def _step_ahead(self) -> list[EngineEvent]:
        """The step of a queued pass: queue the one after it where the same sequences still
        decode, then wait for this one's rows and take them."""
        ahead, self._ahead = self._ahead, None
        self._queue_ahead(ahead.pending, ahead.batch, ahead.seqs)
        picked = ahead.pending.result()
        self.last_pass = ahead.last_pass
        return self._take(ahead.batch, ahead.seqs, picked)

    def _take(self, batch: StepBatch, seqs: list[_Seq], picked: list[Picked]) -> list[EngineEvent]:
        """Advance each sequence of a finished pass by its rows ``picked``; sequences that ended
        while the pass ran (a queued pass: cancelled, or stopped by the pass before) are
        skipped. A queued next pass that was fed a token the host did not take is dropped."""
        live = {id(s) for s in self.running}
        events: list[EngineEvent] = []
        for s, chunk, rows in zip(seqs, batch.chunks, batch.logit_slices()):
            if id(s) not in live:
                continue
            pk = picked[rows]  # [n] Picked
            if s.prefilling:
                if s.req.prompt_logprobs and not s.resumed:
                    self._record_prompt_logprobs(s, chunk, pk)
                s.n_prefilled += chunk.n_tokens
                if s.prefilling or s.resumed:  # a resumed sequence's next token is drawn already
                    s.resumed = s.resumed and s.prefilling
                    self._commit(s)
                    continue
            try:
                events.append(self._verify(s, pk) if s.draft else self._advance(s, pk[-1]))
            except NumericalError as e:  # this request's numbers broke; the others go on
                events.append(self._fail(s, "numerical_error", str(e)))
                continue
            if id(s) in {id(r) for r in self.running}:
                self._commit(s)
        if self._ahead is not None and self._ahead.seqs is seqs:
            fed = [int(p.ids[0]) for p in picked]  # what the queued pass was fed
            live = {id(s) for s in self.running}
            if any(id(s) in live and s.next_token != t for s, t in zip(seqs, fed)):
                self._drop_ahead()  # (greedy rows take their top-1: never, short of a bug)
        return events

    def _queue_ahead(self, pending: PendingPicks, batch: StepBatch, seqs: list[_Seq]) -> None:
        """Queue the pass after ``batch`` (``pending``, not yet taken), fed its top-1 tokens on the
        device, when that is the pass the next step would run: ``run_ahead``, no drafter, the
        running sequences exactly ``seqs``, none with a request waiting for its room, each on one
        greedy row (no repetition penalty) and sure to need a token after the pending one."""
        if not self.run_ahead or self.drafter is not None or not self.model.can_feed or pending.top1 is None:
            return
        if self.waiting and len(self.running) < self.max_batch:
            return
        if len(self.running) != len(seqs) or any(a is not b for a, b in zip(self.running, seqs)):
            return
        for s, chunk in zip(seqs, batch.chunks):
            p = s.req.params
            if s.prefilling or s.draft or chunk.n_tokens != 1 or p.temperature != 0 or p.repetition_penalty != 1.0:
                return
            # the pending pass yields token len(generated)+1, the queued one the one after it
            if len(s.generated) + 1 >= p.max_tokens or len(s.req.prompt_tokens) + len(s.generated) + 1 >= self.max_context:
                return
        be = self.model.backend
        if not all(be.grow_sequence(c.seq_id, c.start_pos + 2) for c in batch.chunks):
            return  # no page for the queued pass's write: the next step finds one, or pauses
        nxt = StepBatch([SeqChunk(c.seq_id, c.start_pos + 1, (0,)) for c in batch.chunks])  # tokens: fed
        last_pass = (self.model.next_pass_id, nxt.n_tokens, 0)
        self._ahead = _Ahead(self.model.launch(nxt, self._picks(nxt, seqs), feed=pending), nxt, seqs, last_pass)
        self.passes_fed += 1

    def _drop_ahead(self) -> None:
        """Forget the queued pass (after it ran: its host buffers are written until then)."""
        if self._ahead is not None:
            self._ahead.pending.result()
            self._ahead = None

    # -- speculation ---------------------------------------------------------------------------
    def _capacity(self, s: _Seq) -> int:
        """The positions ``s`` can reach: its KV cache's size."""
        return min(self.max_context, len(s.req.prompt_tokens) + s.req.params.max_tokens)

    def _draft_depth(self, s: _Seq, depth: int, width: int) -> int:
        """How deep ``s`` may draft now: a verify pass yields up to one token more than its
        depth, and writes a KV entry per node past the last token, so both must stay within
        the request's max_tokens and its KV capacity."""
        pos = len(s.req.prompt_tokens) + len(s.generated) - 1  # where the last token goes
        left = s.req.params.max_tokens - len(s.generated)
        return max(0, min(depth, left - 1, (self._capacity(s) - 1 - pos) // width))

    def _propose_drafts(self, prompt_rows: int) -> None:
        """Ask the drafter for every decoding sequence's draft tree (one batched call), shaped
        as ``TreeShape`` judges best from what it measured so far, for each sequence by its own
        acceptance (one whose drafts are rejected stops drafting, probing now and then, while
        another drafts deep).

        The trees take the rows the pass's ``prompt_rows`` leave (``max_pass_rows``): in a pass
        that carries one, the sequences after the first few may draft less or not at all. So
        drafting adds no rows to the largest pass the plan reserves beside a prompt chunk (on the
        70B at 24 GiB, trees beside a whole chunk made its workspace cost a resident layer); what
        it costs is the drafts of the passes that carry a prompt, never a new request's time to
        its first token."""
        if self.drafter is None:
            return
        reqs, owners, shadows = [], [], []
        decoding = sum(1 for s in self.running if not s.prefilling and not s.paused)
        tree_rows_left = self.max_pass_rows - decoding - prompt_rows
        for s in self.running:
            s.shadow = s.draft = None  # a tree proposed while paused (no pass took it) is proposed again
            if s.prefilling or s.paused or not s.req.speculative:
                continue
            if s.acceptance is None:
                s.acceptance = self.shape.acc.copy()
            # the pass's other rows: at least one per other decoding sequence
            depth, width = self.shape.choose(s.acceptance, other_rows=max(0, decoding - 1))
            wanted = self._draft_depth(s, depth, width)
            d = min(wanted, tree_rows_left // width)
            self.trees_cut += int(d < wanted)
            pos = len(s.req.prompt_tokens) + len(s.generated) - 1
            if d > 0 and not self.model.backend.grow_sequence(s.seq_id, pos + 1 + d * width):
                d = 0  # no pages for the tree: this pass decodes one token
            if d > 0:
                tree_rows_left -= d * width
                weak = self.shape.weak_pays(d * width + 1, max(0, decoding - 1))
                # until a verify pass was timed nothing says whether rows cost: the lookahead's
                # window then rides along once, and that pass measures them (a text the prompt
                # lookup finds nothing in would otherwise never verify, and never find out)
                rows_free = weak or not self.shape.verify_by_rows
                reqs.append(DraftRequest(s.seq_id, s.req.prompt_tokens + s.generated, d, width, self._capacity(s), weak,
                                         rows_free=rows_free))
                owners.append(s)
            elif depth == 0 and self._draft_depth(s, 1, 1) > 0 and self.shape.shadow_probe(s.acceptance):
                reqs.append(DraftRequest(s.seq_id, s.req.prompt_tokens + s.generated, 1, 1, self._capacity(s)))
                shadows.append(s)
        if reqs:
            trees = self.drafter.propose(reqs)
            self.shape.observe_times(depth_s=self.drafter.depth_s)  # a model drafter's catch-up left out
            for s, tree in zip(owners, trees):
                s.draft = tree or None  # a drafter may have nothing to propose
            for s, tree in zip(shadows, trees[len(owners):]):
                s.shadow = tree or None

    def _verify(self, s: _Seq, pk: list[Picked]) -> EngineOutput:
        """Accept what the pass confirms of ``s``'s draft, plus the target's own next token, and
        emit them in order until the request finishes."""
        history = s.req.prompt_tokens + s.generated if s.req.params.repetition_penalty != 1.0 else []
        tree, s.draft = s.draft, None
        tokens, path = verify_tree(tree, pk, s.sampler, history)
        if path != list(range(len(path))):  # a sibling was taken: close the path's KV entries up
            pos = len(s.req.prompt_tokens) + len(s.generated)  # node i sits at pos + i
            # the path's first nodes before the sibling are where they belong: only the rest move
            moved = [(i, k) for k, i in enumerate(path) if i != k]
            self.model.kv_keep(s.seq_id, [pos + i for i, _ in moved], [pos + k for _, k in moved])
        self.shape.observe(tree, path, s.acceptance)
        self.spec.add(len(tree), len(path), tree.weak)
        if self.drafter.learns_from_rows:  # the lookahead's window and recycled tokens: every row's best
            k = self.drafter.row_top_k
            self.drafter.verified(s.seq_id, tree, [ranked_of(p, k) for p in pk], path)
        rows = [0] + [i + 1 for i in path]  # token k was drawn from the row of its parent
        return self._emit(s, [(tok, pk[row]) for tok, row in zip(tokens, rows)], len(tree), len(path))

    def _picks(self, batch: StepBatch, seqs: list[_Seq]) -> list[Pick]:
        """What each logit row must come back as: the sampler's candidates on the row a token is
        drawn from, the prompt log-probabilities' top-k on scored prompt rows, the top-1 on a
        prefill chunk's unused last row. Only these cross from the device, not [N, V] logits."""
        n_vocab = self.model.hp.n_vocab
        out: list[Pick] = []
        for s, chunk in zip(seqs, batch.chunks):
            if not s.prefilling and s.draft:  # every row of a verified chunk is sampled from
                out.extend([s.sampler.pick(n_vocab, s.req.logprobs, rank=self.drafter.row_top_k)] * chunk.n_tokens)
                continue
            finishes_prompt = not s.prefilling or (s.n_prefilled + chunk.n_tokens >= len(s.prefill_tokens)
                                                   and not s.resumed)
            last = s.sampler.pick(n_vocab, s.req.logprobs) if finishes_prompt else Pick(1)
            if chunk.all_logits:  # row j scores prompt token start_pos + j + 1, when there is one
                k, prompt = s.req.prompt_logprobs, s.req.prompt_tokens
                out.extend(Pick(k, lse=True, token=prompt[chunk.start_pos + j + 1]) for j in range(chunk.n_tokens - 1))
                scored_last = prompt[chunk.end_pos] if chunk.end_pos < len(prompt) else None
                last = Pick(0) if last.k == 0 else Pick(max(last.k, k), lse=True, token=scored_last)
            out.append(last)
        return out

    def _record_prompt_logprobs(self, s: _Seq, chunk: SeqChunk, pk: list[Picked]) -> None:
        prompt = s.req.prompt_tokens
        if chunk.start_pos == 0:
            s.prompt_lp.append(None)
        for j in range(chunk.n_tokens):
            target = chunk.start_pos + j + 1  # row j predicts prompt token j+1
            if target < len(prompt):
                s.prompt_lp.append(self._prompt_entry(pk[j], s.req.prompt_logprobs, prompt[target]))

    @classmethod
    def _prompt_entry(cls, pk: Picked, k: int, tok: int) -> list[list]:
        """A ``prompt_logprobs`` entry: the top-k pairs, then the actual prompt token's pair when
        it is not among them (as vLLM does), so the list stays best first."""
        entry = cls._logprob_entry(pk, k)
        if all(i != tok for i, _ in entry):
            entry.append([int(tok), cls._token_logprob(pk, tok)])
        return entry

    @staticmethod
    def _logprob_entry(pk: Picked, k: int) -> list[list]:
        """The top-k ``[token id, log-probability]`` pairs of a distribution, best first."""
        if pk.row is not None:
            return [[int(i), float(p)] for i, p in logprobs_topk(pk.row, k)]
        return [[int(i), float(v - pk.lse)] for i, v in zip(pk.ids[:k], pk.vals[:k])]

    @staticmethod
    def _token_logprob(pk: Picked, tok: int) -> float:
        if pk.row is not None:
            return float(pk.row[tok] - log_normaliser(pk.row))
        hit = np.flatnonzero(pk.ids == tok)
        return float((pk.vals[int(hit[0])] if hit.size else pk.token_val) - pk.lse)

    def _advance(self, s: _Seq, pk: Picked) -> EngineOutput:
        """Sample the next token of ``s`` from its last row's pick; emit and maybe finish."""
        # the history only matters to the repetition penalty: build it only then
        history = s.req.prompt_tokens + s.generated if s.req.params.repetition_penalty != 1.0 else ()
        tok = s.sampler.sample_picked(pk, history)
        if s.shadow is not None:  # a shadow probe: accepted where the pass yields the proposed token
            shadow, s.shadow = s.shadow, None
            taken = shadow.tokens[0] == tok
            self.shape.observe(shadow, [0] if taken else [], s.acceptance)
            self.probes, self.probes_accepted = self.probes + 1, self.probes_accepted + int(taken)
        return self._emit(s, [(tok, pk)])

    def _emit(self, s: _Seq, drawn: list[tuple[int, Picked]], drafted: int = 0, accepted: int = 0) -> EngineOutput:
        """Append the tokens ``drawn`` (each with the row it was drawn from) to ``s`` in order,
        until one finishes the request (a stop token, max_tokens or the context's end): its
        output, and its end if it came."""
        if not s.generated:
            s.t_first_token_s = time.monotonic()
        k = s.req.logprobs
        tokens: list[int] = []
        tops: list[list[list]] = []
        own: list[float] = []
        reason = None
        for tok, pk in drawn:
            self.tokens_generated += 1
            if tok in self.stop_token_ids:
                reason = "stop"
                break
            s.generated.append(tok)
            s.next_token = tok
            tokens.append(tok)
            if k:
                tops.append(self._logprob_entry(pk, k))
                own.append(self._token_logprob(pk, tok))
            if len(s.generated) >= s.req.params.max_tokens or len(s.req.prompt_tokens) + len(s.generated) >= self.max_context:
                reason = "length"
                break
        if reason is not None:
            self.running.remove(s)
            self._commit(s)
            self._release(s)
        return self._output(s, tokens, reason, tops if k else None, own if k else None, drafted, accepted)

    def _output(self, s: _Seq, tokens: list[int], reason: str | None = None, logprobs: list | None = None,
                token_logprobs: list[float] | None = None, drafted: int = 0, accepted: int = 0) -> EngineOutput:
        """``s``'s output with its timings as of now; its prompt log-probabilities with the first."""
        now = time.monotonic()
        prompt_lp = s.prompt_lp if s.req.prompt_logprobs and not s.started else None
        s.started = True
        return EngineOutput(
            id=s.req.id, tokens=tokens, finish_reason=reason, logprobs=logprobs, token_logprobs=token_logprobs,
            prompt_logprobs=prompt_lp, queued_s=(s.t_admit_s or now) - s.t_submit_s,
            prefill_s=(s.t_first_token_s or now) - (s.t_admit_s or now),
            decode_s=now - s.t_first_token_s if s.t_first_token_s else 0.0, drafted=drafted, accepted=accepted,
        )

    def _release(self, s: _Seq) -> None:
        """Free the sequence's KV cache and its id."""
        if s.seq_id >= 0:
            self.model.backend.free_sequence(s.seq_id)
            if self.drafter is not None:
                self.drafter.forget(s.seq_id)
        self._ids.discard(s.req.id)

    def _fail(self, s: _Seq, code: str, message: str) -> EngineError:
        self.running.remove(s)
        self._release(s)
        return EngineError(id=s.req.id, code=code, message=message)

    def _finish(self, s: _Seq, reason: str) -> EngineOutput:
        """End ``s`` (out of the queues already) with ``reason``."""
        self._release(s)
        return self._output(s, [], reason)
