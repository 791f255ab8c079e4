"""Would the recycled tokens reach issue 28's 2.0 on summarising if they started from the prompt?
(an experiment: the engine does not do this)

``--draft lookahead`` recycles what the target ranked after each token, but only from verify
passes: a request starts with what earlier requests left. A prefill ranks every prompt position
anyway when asked (``prompt_logprobs``), so the matrix could start with the model's own guesses
after each prompt token, in the document's context, before the first draft. This script measures
what that would give: it runs scripts/draft_acceptance.py with ``LocalEngine.submit`` wrapped so
that, before each request reaches a lookahead engine, a separate plain engine scores the request's
prompt (``prompt_logprobs=RECYCLE_K``, one token generated) and every prompt position's top tokens
are learnt as what follows the token before it (``RecycledTokens.learn``), oldest first, so the
prompt's last positions are the newest entries. The greedy tokens are checked against plain as
always (priming changes what is drafted, never what is accepted). Arguments go to
draft_acceptance.py as they are:

    python dev/spec/recycling_primed.py --tokens 192 --draft-tokens 63 --drafters lookahead:1:fixed --json OUT
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import ntx.ctl.local as local
import ntx.daemons.compute.lookahead as lookahead
from ntx.shared.config import EngineOptions
from ntx.shared.messages import EngineRequest
from ntx.shared.sampling_fields import SamplingParams


def prime(recycled: lookahead.RecycledTokens, prompt: list[int], entries: list) -> int:
    """Learn ``entries`` (a ``prompt_logprobs`` list: entry i the ``[token, logprob]`` pairs at
    prompt position i, best first, entry 0 None) into ``recycled``: entry i's top tokens as
    what follows ``prompt[i - 1]``, in prompt order. Returns the positions learnt."""
    n = 0
    for i, entry in enumerate(entries):
        if i >= 1 and entry:
            recycled.learn(prompt[i - 1], [int(t) for t, _ in entry[: lookahead.RECYCLE_K]])
            n += 1
    return n


def main() -> None:
    scorer = {}  # model path -> the plain engine that scores prompts (built on first use)
    primed = {"requests": 0, "positions": 0}
    submit = local.LocalEngine.submit

    def score(model: str, prompt: list[int]) -> list:
        if model not in scorer:
            scorer[model] = local.build_local_engine(model, "cpu", options=EngineOptions(max_batch=1, ctx=2048))
        eng = scorer[model]
        eng.submit(EngineRequest("prime", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                                 prompt_logprobs=lookahead.RECYCLE_K))
        entries = None
        while eng.has_work:
            for ev in eng.step():
                if ev.get("prompt_logprobs") is not None:
                    entries = ev["prompt_logprobs"]
                if ev["type"] == "error":
                    raise RuntimeError(ev["message"])
        return entries or []

    def primed_submit(self, req: EngineRequest, stream: bool = True) -> None:
        drafter = getattr(self.core, "drafter", None)
        if isinstance(drafter, lookahead.LookaheadDrafter):
            prompt = list(req.prompt_tokens)
            primed["positions"] += prime(drafter.recycled, prompt, score(MODEL[0], prompt))
            primed["requests"] += 1
        return submit(self, req, stream)

    build = local.build_local_engine
    MODEL: list[str] = []

    def remembering_build(model_path: str, *args, **kwargs):
        if not MODEL:
            MODEL.append(model_path)
        return build(model_path, *args, **kwargs)

    local.LocalEngine.submit = primed_submit
    local.build_local_engine = remembering_build
    script = Path(__file__).resolve().parents[2] / "scripts" / "draft_acceptance.py"
    sys.argv = [str(script)] + [a for a in sys.argv[1:] if a != "--"]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        print(f"primed {primed['requests']} requests, {primed['positions']} prompt positions learnt", flush=True)


if __name__ == "__main__":
    main()
