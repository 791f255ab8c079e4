"""The cluster router's choice on crafted replica states (ctl/cluster/router.py): the replica
holding the longest prefix while the load allows, else the less loaded of two."""

from __future__ import annotations

import random
import time

import pytest

from ntx.ctl.cluster import router as rt
from ntx.ctl.cluster.router import Candidate, PrefixRouter, answered_key, block_names, request_key

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one short sentence. " * 2}


def chat(*turns: str) -> dict:
    return {"messages": [SYSTEM, *({"role": "user" if i % 2 == 0 else "assistant", "content": t}
                                   for i, t in enumerate(turns))]}


def loads(**in_flight: int) -> list[Candidate]:
    return [Candidate(name, n) for name, n in in_flight.items()]


@pytest.fixture
def router() -> PrefixRouter:
    return PrefixRouter(random.Random(0))


def test_keys_share_blocks_exactly_while_they_share_the_prefix():
    first = request_key(chat("What is the capital of France?"))
    later = answered_key(chat("What is the capital of France?"), "Paris.") + request_key(
        {"messages": [{"role": "user", "content": "And of Spain?"}]})
    a, b = block_names(first), block_names(later)
    assert len(b) > len(a) > 0
    assert a == b[: len(a)]  # the next turn starts with the whole earlier prompt
    other = block_names(request_key(chat("Name a prime number.")))
    n_system = len(request_key({"messages": [SYSTEM]})) // rt.BLOCK_CHARS
    assert n_system > 0 and other[:n_system] == a[:n_system]  # the shared system prompt's blocks
    assert set(other[n_system:]).isdisjoint(a)  # none after the first difference
    # token ids never match a raw prompt of the same digits
    ids = list(range(40))
    assert set(block_names(request_key({"tokens": ids}))).isdisjoint(
        block_names(request_key({"prompt": "".join(f"{t}," for t in ids)})))


def test_a_later_turn_goes_to_the_replica_holding_its_prefix(router):
    first = chat("What is the capital of France?")
    router.record(answered_key(first, "Paris is the capital."), "r1")
    second = chat("What is the capital of France?", "Paris is the capital.", "And of Spain?")
    choice = router.choose(request_key(second), loads(r0=0, r1=2))
    assert (choice.name, choice.reason) == ("r1", "prefix")
    assert choice.matched_blocks == len(block_names(answered_key(first, "Paris is the capital.")))


def test_the_longest_prefix_wins_over_a_shorter_one(router):
    turn = chat("Tell me about owls.", "Owls hunt at night and see well in the dark.", "What do they eat?")
    router.record(request_key({"messages": [SYSTEM]}), "r0")  # only the shared system prompt
    router.record(answered_key(chat("Tell me about owls."), "Owls hunt at night and see well in the dark."), "r2")
    choice = router.choose(request_key(turn), loads(r0=0, r1=0, r2=1))
    assert (choice.name, choice.reason) == ("r2", "prefix")


def test_imbalance_beyond_the_threshold_sends_it_to_the_less_loaded(router):
    key = request_key(chat("What is the capital of France?"))
    router.record(key, "r0")
    at_limit = router.choose(key, loads(r0=rt.IMBALANCE_REQUESTS, r1=0))
    assert (at_limit.name, at_limit.reason) == ("r0", "prefix")
    beyond = router.choose(key, loads(r0=rt.IMBALANCE_REQUESTS + 1, r1=0))
    assert (beyond.name, beyond.reason) == ("r1", "least_loaded")


def test_two_holders_the_less_loaded_one_gets_it(router):
    key = request_key(chat("What is the capital of France?"))
    router.record(key, "r0")
    router.record(key, "r1")
    assert router.choose(key, loads(r0=3, r1=1)).name == "r1"


def test_a_match_below_the_minimum_share_is_no_match(router):
    short = "x" * rt.BLOCK_CHARS
    long = short + "y" * (rt.BLOCK_CHARS * int(2 / rt.MIN_MATCH_FRACTION))
    router.record(short, "r0")
    choice = router.choose(long, loads(r0=0, r1=0))
    assert choice.reason == "least_loaded" and choice.matched_blocks in (0, 1)
    assert router.choose(short + "z" * rt.BLOCK_CHARS, loads(r0=1, r1=0)).reason == "prefix"  # 1 of 2 blocks


def test_no_prefix_power_of_two_picks_the_less_loaded_of_two():
    counts = {"r0": 0, "r1": 0, "r2": 0}
    r = PrefixRouter(random.Random(1))
    for i in range(300):
        counts[r.choose(f"request {i}", loads(r0=0, r1=5, r2=9)).name] += 1
    # r0 is in 2 of the 3 pairs and wins both; r1 wins the pair (r1, r2); r2 never wins
    assert counts["r2"] == 0 and counts["r0"] > counts["r1"] > 0
    assert r.choose("x", loads(only=7)).name == "only"
    assert r.choose("x", []) is None


def test_a_restarted_replica_holds_nothing(router):
    key = request_key(chat("What is the capital of France?"))
    router.record(key, "r0")
    router.record(key, "r1")
    router.forget_replica("r0")
    assert router.match(block_names(key), "r0") == 0
    assert router.match(block_names(key), "r1") == len(block_names(key))
    router.forget_replica("r1")
    assert not router.holders


def test_the_map_is_bounded_least_recent_first():
    r = PrefixRouter(random.Random(0), max_blocks=8)
    old, new = "a" * rt.BLOCK_CHARS * 4, "b" * rt.BLOCK_CHARS * 6
    r.record(old, "r0")
    r.record(new, "r1")
    assert len(r.holders) == 8
    assert r.match(block_names(new), "r1") == 6  # the newest is whole
    assert r.match(block_names(old), "r0") == 0  # the oldest blocks went first


# ------------------------------------------------------------------ which replicas the ingress routes to
from ntx.ctl.cluster.link import STATUS_LOST_S, ClusterLink  # noqa: E402
from ntx.ctl.gateway.link import FrameTooLarge, PipelineGone  # noqa: E402


def _link(*names: str) -> ClusterLink:
    """A cluster link over replicas without handles: routing reads only what it observed."""
    return ClusterLink([(n, None) for n in names], reply_timeout_s=60, router=PrefixRouter(random.Random(0)))


def _report(state: str, pid: int = 100, gen: int = 0, running: bool = True) -> dict:
    return {"instance": "i", "instance_running": running,
            "status": {"state": state, "supervisor_pid": pid, "gen": gen, "requests": {}}}


def test_only_replicas_ready_on_evidence_are_routed_to():
    link = _link("r0", "r1")
    assert link.route("k", set()) is None  # nothing observed yet
    link.replicas["r0"].observe(_report("ready"))
    link.replicas["r1"].observe(_report("restarting"))
    assert {link.route(f"k{i}", set()).name for i in range(20)} == {"r0"}
    assert link.route("k", {"r0"}) is None  # tried already
    link.replicas["r1"].observe({"instance": "i", "instance_running": True, "status": None})
    assert not link.replicas["r1"].ready  # an instance that did not answer keeps its last status
    link.replicas["r1"].observe(_report("ready"))
    assert link.replicas["r1"].ready


def test_a_failure_or_a_long_silence_takes_a_replica_out_a_slow_answer_does_not():
    link = _link("r0")
    r0 = link.replicas["r0"]
    r0.observe(_report("ready"))
    r0.observe({"instance": "i", "instance_running": True, "status": None})  # late: no evidence
    assert r0.ready
    r0.mark_failed()
    assert not r0.ready and r0.failed == 1
    r0.observe(_report("ready"))  # a status after the failure
    assert r0.ready
    r0.status_at_s -= STATUS_LOST_S + 1
    assert not r0.ready and r0.status is None
    r0.observe(_report("ready", running=False))
    assert not r0.ready and r0.status == {"state": "exited"}


def test_submit_checks_the_frame_and_that_a_replica_is_ready():
    link = _link("r0")
    with pytest.raises(PipelineGone):
        link.submit({"prompt": "hi", "raw": True})
    link.replicas["r0"].observe(_report("ready"))
    with pytest.raises(FrameTooLarge):
        link.submit({"prompt": "x" * (17 << 20), "raw": True})
    stream = link.submit({"prompt": "hi", "raw": True})
    assert link.in_flight == 1 and not stream.finished
    link.forget(stream)
    assert link.in_flight == 0


def test_only_a_fault_since_a_request_was_sent_sends_it_elsewhere():
    """A stalled pipeline (its first prefill of a batch on busy cores) or a refusal for load
    takes a replica out of the choice for new requests, but a request already waiting there
    for its first reply goes elsewhere only on a fault since it was sent."""
    link = _link("r0")
    r0 = link.replicas["r0"]
    r0.observe(_report("ready"))
    sent_s = time.monotonic()
    r0.observe(_report("stalled"))
    assert not r0.ready and not r0.lost_since(sent_s)
    r0.mark_failed(fault=False)  # overloaded
    assert not r0.lost_since(sent_s) and r0.failed == 1
    r0.mark_failed()
    assert r0.lost_since(sent_s) and not r0.lost_since(time.monotonic())
    later_s = time.monotonic()
    r0.observe(_report("ready", running=False))
    assert r0.lost_since(later_s)
