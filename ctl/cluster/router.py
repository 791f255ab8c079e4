"""Which replica a cluster request goes to: the one holding the longest prefix of it while the
load allows, else the less loaded of two picked at random (power of two choices).

An ntx instance keeps the KV of the prompts it served (its prefix cache, ``kv.prefix_hit_tokens``
in its status): a conversation's next turn, or a request sharing a long system prompt, costs
only its new tokens on the replica that served the earlier one, and all of them elsewhere. The
router cannot see those caches; it keeps its own map of what it sent where. A request's *key*
is its prompt as text (chat messages as ``role`` and ``content`` in order, a raw prompt as it
is, token ids as digits), cut into blocks of ``BLOCK_CHARS``; each block is named by a hash of
everything up to its end, so two keys share a block name exactly when they share that whole
prefix. After a request finishes, its key with the generated text appended is recorded for
its replica (the instance holds the answer's KV too: the next turn's prompt starts with it).

The choice (``PrefixRouter.choose``), with the thresholds as constants:

1. the replicas that can take requests (ready, and not excluded: one already tried for this
   request) are the candidates;
2. each candidate's *match* is how many of the key's leading blocks the router recorded for it;
   the best match counts if it is at least ``MIN_MATCH_BLOCKS`` blocks and ``MIN_MATCH_FRACTION``
   of the key;
3. the load balance holds for a candidate when its requests in flight exceed the least loaded
   candidate's by at most ``IMBALANCE_REQUESTS``; the least loaded candidate among those with
   the best match for which it holds gets the request (reason ``prefix``);
4. otherwise two candidates are picked at random and the one with fewer requests in flight
   gets it (reason ``least_loaded``): near the best choice at a fraction of the cost of
   tracking all loads exactly, and no herd on one replica when load reports lag.

The map is bounded (``MAX_BLOCKS`` block names, least recently used dropped first), and a
replica's entries are dropped when it restarts (``forget_replica``: its cache is empty).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

BLOCK_CHARS = 32  # a block of the key: short enough that a short conversation turn fills some
MIN_MATCH_BLOCKS = 1  # a match shorter than this is no match
MIN_MATCH_FRACTION = 0.1  # nor one covering less than this share of the request's key
IMBALANCE_REQUESTS = 4  # prefix affinity holds while the holder has at most this many more in flight
MAX_BLOCKS = 200_000  # block names remembered (about 100 bytes each with their replica sets)

MESSAGE_END = "\x1f"  # between messages of a chat key (a unit separator: not in ordinary text)
ROLE_END = "\x1e"
TOKENS_KEY = "\x1dtokens\x1d"  # the start of a token-id key: never a raw prompt's


def request_key(wire: dict) -> str:
    """A ``generate`` request's prompt as the text the router matches prefixes on."""
    if "messages" in wire:
        return "".join(message_key(m.get("role", ""), m.get("content", "")) for m in wire["messages"])
    if "tokens" in wire:
        return TOKENS_KEY + "".join(f"{t}," for t in wire["tokens"])
    return str(wire.get("prompt", ""))


def message_key(role: str, content: str) -> str:
    return f"{role}{ROLE_END}{content}{MESSAGE_END}"


def answered_key(wire: dict, text: str) -> str:
    """The key of what an instance holds after answering ``wire`` with ``text``: the prompt and
    the answer (a chat's next turn starts with the assistant's message)."""
    if "messages" in wire:
        return request_key(wire) + message_key("assistant", text)
    return request_key(wire) + ("" if "tokens" in wire else text)


def block_names(key: str) -> list[bytes]:
    """One name per whole block of ``key``: a hash of the key up to that block's end."""
    h = hashlib.blake2b(digest_size=12)
    names = []
    for end in range(BLOCK_CHARS, len(key) + 1, BLOCK_CHARS):
        h.update(key[end - BLOCK_CHARS:end].encode("utf-8", "surrogatepass"))
        names.append(h.copy().digest())
    return names


@dataclass
class Candidate:
    """A replica as the router sees it when choosing: its name and requests in flight."""

    name: str
    in_flight: int


@dataclass
class Choice:
    name: str
    reason: str  # "prefix" or "least_loaded"
    matched_blocks: int
    key_blocks: int


class PrefixRouter:
    """The prefix map and the choice (module docstring). One per ingress; not thread safe (the
    ingress calls it from its event loop)."""

    def __init__(self, rng: random.Random | None = None, max_blocks: int = MAX_BLOCKS) -> None:
        self.rng = rng or random.Random()
        self.max_blocks = max_blocks
        self.holders: OrderedDict[bytes, set[str]] = OrderedDict()  # block name -> replicas that hold it

    def match(self, names: Sequence[bytes], replica: str) -> int:
        """How many of ``names``' leading blocks ``replica`` holds."""
        n = 0
        for name in names:
            held = self.holders.get(name)
            if held is None or replica not in held:
                break
            n += 1
        return n

    def choose(self, key: str, candidates: Sequence[Candidate]) -> Choice | None:
        """The replica for a request of ``key`` (None: no candidates)."""
        if not candidates:
            return None
        names = block_names(key)
        least = min(c.in_flight for c in candidates)
        matches = {c.name: self.match(names, c.name) for c in candidates}
        best = max(matches.values())
        if best >= MIN_MATCH_BLOCKS and best >= MIN_MATCH_FRACTION * len(names):
            holders = [c for c in candidates if matches[c.name] == best and c.in_flight <= least + IMBALANCE_REQUESTS]
            if holders:
                pick = min(holders, key=lambda c: c.in_flight)
                return Choice(pick.name, "prefix", best, len(names))
        two = self.rng.sample(list(candidates), min(2, len(candidates)))
        pick = min(two, key=lambda c: c.in_flight)
        return Choice(pick.name, "least_loaded", matches[pick.name], len(names))

    def record(self, key: str, replica: str) -> None:
        """``replica`` now holds ``key``'s blocks (it served a request of that key)."""
        for name in block_names(key):
            held = self.holders.get(name)
            if held is None:
                held = self.holders[name] = set()
            else:
                self.holders.move_to_end(name)
            held.add(replica)
        while len(self.holders) > self.max_blocks:
            self.holders.popitem(last=False)

    def forget_replica(self, replica: str) -> None:
        """``replica`` restarted: nothing it held is held any more."""
        for name in [n for n, held in self.holders.items() if replica in held]:
            held = self.holders[name]
            held.discard(replica)
            if not held:
                del self.holders[name]
