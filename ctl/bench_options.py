"""``ntxctl bench``'s options that are no instance option: the spec scenario's knobs and the
context of the other scenarios. Apart from ``ctl/bench.py`` so that ntxctl reads their defaults
for its ``--help`` without importing the benchmark (numpy, the daemons' parts)."""

from __future__ import annotations

from dataclasses import dataclass

from ntx.shared.config import MAX_DRAFT_TOKENS
from ntx.shared.errors import ConfigError
from ntx.shared.stats import KEEP_PASSES

BENCH_CTX = 512  # positions per sequence in (a), (b), (c), (d), check and skip: the prompt and the generated tokens fit
# the spec scenario's runs after its plain one (--spec-cases): the verify passes timed per chain, the
# controlled acceptance, every draft wrong; the traces given run whatever this says
SPEC_CASES = ("verify", "controlled", "wrong")


@dataclass(frozen=True)
class SpecOptions:
    """The spec scenario's knobs (``ntxctl bench --spec-*``); small values keep a CPU run short.

    ``verify_draft_tokens``: the chain lengths K timed, each for ``verify_passes`` verify passes
    after one warm-up pass; ``accept_draft_tokens`` K and ``accept_length`` the expected accepted
    tokens per pass of the controlled-acceptance run, ``accept_tokens`` the tokens it generates;
    ``draft_model``: a GGUF whose drafter runs behind the replay (its cost paid); ``batch`` > 1:
    the controlled-acceptance runs again with that many concurrent requests, beside plain;
    ``accept_traces``: files of a real drafter's (drafted, accepted) passes on real text
    (scripts/draft_acceptance.py --trace-out), each replayed as one more run; ``trace_tokens``:
    the tokens each of those runs generates (``replay.trace_tokens``: the whole trace once, so that
    its figure is the text's and not its first passes'), at least ``accept_tokens``; ``cases``: which
    of ``SPEC_CASES`` run (a trace's replay alone fits one call of a machine lent by the minute:
    the plain reference of a long trace takes minutes by itself)."""

    verify_draft_tokens: tuple[int, ...] = (1, 8, 32, 128, 512)
    verify_passes: int = 2
    accept_draft_tokens: int = 8
    accept_length: float = 6.0
    accept_tokens: int = 64
    draft_model: str | None = None
    batch: int = 1
    accept_traces: tuple[str, ...] = ()
    trace_tokens: tuple[int, ...] = ()
    cases: tuple[str, ...] = SPEC_CASES

    def validate(self) -> SpecOptions:
        for flag, ks in (("--spec-verify-draft-tokens", self.verify_draft_tokens),
                         ("--spec-accept-draft-tokens", (self.accept_draft_tokens,))):
            if not ks or not all(1 <= k <= MAX_DRAFT_TOKENS for k in ks):
                raise ConfigError(f"{flag} {','.join(map(str, ks))}: each from 1 to {MAX_DRAFT_TOKENS}")
        if not 1 <= self.verify_passes < KEEP_PASSES:  # the timed run's passes on compute's clock, its prefill's too
            raise ConfigError(f"--spec-verify-passes {self.verify_passes}: from 1 to {KEEP_PASSES - 1} (compute's "
                              f"status keeps its last {KEEP_PASSES} passes)")
        if not 0 <= self.accept_length <= self.accept_draft_tokens:
            raise ConfigError(f"--spec-accept-length {self.accept_length}: from 0 to --spec-accept-draft-tokens "
                              f"({self.accept_draft_tokens})")
        if self.accept_tokens < 2:
            raise ConfigError(f"--spec-tokens {self.accept_tokens}: at least 2")
        if self.trace_tokens and len(self.trace_tokens) != len(self.accept_traces):
            raise ValueError("SpecOptions.trace_tokens: one count per file of accept_traces")
        if self.batch < 1:
            raise ConfigError(f"--spec-batch {self.batch}: at least 1")
        unknown = [c for c in self.cases if c not in SPEC_CASES]
        if unknown:
            raise ConfigError(f"--spec-cases {','.join(self.cases)}: {unknown[0]!r} is none of {', '.join(SPEC_CASES)}")
        return self

    def verify_tokens(self, k: int) -> int:
        """max_tokens of a timed chain run: the prefill's token, then ``verify_passes`` passes that
        each draft k tokens and, every one right, yield k + 1 (a pass drafts only what max_tokens
        leaves room for, so fewer would shorten the last chains)."""
        return 1 + self.verify_passes * (k + 1)

    def trace_run_tokens(self, i: int) -> int:
        """max_tokens of the run that replays ``accept_traces[i]``."""
        return max(self.accept_tokens, self.trace_tokens[i] if self.trace_tokens else 0)

    @property
    def reference_tokens(self) -> int:
        """The greedy continuation the plain run must record: what the longest run replays."""
        return max([self.verify_tokens(k) for k in self.verify_draft_tokens if "verify" in self.cases]
                   + [self.accept_tokens if {"controlled", "wrong"} & set(self.cases) else 0,
                      self.accept_draft_tokens + 2]
                   + [self.trace_run_tokens(i) for i in range(len(self.accept_traces))])
