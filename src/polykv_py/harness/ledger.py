"""The randomized oracle's own account of what each slot may hold (independent of the server's provenance).

The server decides whether cells may be shared from what it records with them (patch 0078). A test that only
asked the server would inherit its mistakes, so the oracle keeps this ledger from what it sent and what the
answers say (``id_slot`` of every choice, ``shared_prefix.pool_slot`` and ``shared``, ``timings.cache_n``,
``/slots`` pool states) and checks every cell a request took against it:

- a :class:`Holder` is content a slot may hold: the tokens of one request's prompt and answer, the tenant (salt
  and LoRA set) that computed them, and how many leading cells are exact (a request that asked for chunk reuse
  moved the ones after its common prefix with the slot's previous prompt);
- traffic runs in rounds: a slot may hold, during round k, what it held at the end of round k-1 or anything a
  request of round k put there; at the end of the round it holds what round k's requests left (children are
  cleared at release, as upstream does), reserved pools what ``/slots`` shows, matched by hash or keyed MAC;
- a request that took ``n`` cells from slot ``s`` (a share, or its own slot's cache) is checked against the
  holders of ``s`` whose first ``n`` tokens are its own: if none is of its tenant, another tenant's cells were
  used (``salt``); if those of its tenant all have fewer than ``n`` exact cells, moved cells were shared as
  exact (``inexact``). A pool ``/slots`` shows unsalted while only salted content matches it is ``shown_unsalted``.

Candidates form a superset of what a slot can hold, so a finding is a definite violation, never a guess;
``unexplained`` counts takes the ledger cannot account for at all (a gap in the model, reported, not failed).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..tokens import common_prefix_len

#: Exact up to any length.
ALL = 2**31 - 1

#: (cache_salt or "", a LoRA adapter applied): whose cells they are.
TenantKey = tuple[str, bool]

FindingKind = Literal["salt", "inexact", "shown_unsalted"]


def _packed(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def sha256_of(tokens: Sequence[int]) -> str:
    """How /slots names an unsalted pool's tokens."""
    return hashlib.sha256(_packed(tokens)).hexdigest()


def mac_of(tokens: Sequence[int], salt: str) -> str:
    """How /slots names a salted pool's tokens (HMAC-SHA256 keyed with the salt)."""
    return hmac.new(salt.encode("utf-8"), _packed(tokens), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Holder:
    """Content a slot may hold."""

    key: TenantKey
    tokens: tuple[int, ...]
    exact: int = ALL  # cells [0, exact) computed from these tokens at these positions
    child: bool = False  # an n_cmpl child: cleared when it is released
    origin: str = ""  # the request (or action) that put it there

    def truncated(self, n: int) -> Holder:
        return replace(self, tokens=self.tokens[:n], child=False)


@dataclass(frozen=True)
class Finding:
    """A definite violation: cells a request must not have got, or a pool shown as what it is not."""

    kind: FindingKind
    detail: str


@dataclass(frozen=True)
class PoolView:
    """What /slots says of a reserved pool (``polykv_pool_state``)."""

    resident: bool
    salted: bool | str
    tokens_sha256: str | None
    tokens_mac: str | None

    @classmethod
    def from_slot(cls, state: Mapping[str, Any]) -> PoolView:
        return cls(bool(state["resident"]), state["salted"], state.get("tokens_sha256"), state.get("tokens_mac"))


@dataclass
class Ledger:
    """Residents per slot, the holders a round adds, and the checks (see the module docstring)."""

    slots: Sequence[int]
    pools: Sequence[int]
    resident: dict[int, list[Holder]] = field(default_factory=dict)
    created: dict[int, list[Holder]] = field(default_factory=lambda: defaultdict(list))
    promoted: list[Holder] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    round: int = 0

    def __post_init__(self) -> None:
        for s in self.slots:
            self.resident.setdefault(s, [])

    # -- what happens ------------------------------------------------------------------
    def begin_round(self) -> None:
        self.round += 1
        self.created = defaultdict(list)
        self.promoted = []

    def add(self, slot: int, holder: Holder) -> None:
        """A request of this round put ``holder`` into ``slot``."""
        self.created[slot].append(holder)

    def set_resident(self, slot: int, holders: Iterable[Holder]) -> None:
        """Between rounds: ``slot`` now holds one of ``holders`` (a restore), or nothing (an erase: ``[]``)."""
        self.resident[slot] = list(holders)

    def candidates(self, slot: int, tokens: Sequence[int], n: int, *, exclude: str = "") -> list[Holder]:
        """The holders ``slot`` may have had during the round whose first ``n`` tokens are ``tokens[:n]``."""
        want = tuple(tokens[:n])
        held = [*self.resident.get(slot, []), *self.created.get(slot, [])]
        if slot in self.pools:
            held += self.promoted  # a share of this round from an agent's slot may have been copied here
        return [h for h in held if (not exclude or h.origin != exclude) and h.tokens[:n] == want and len(h.tokens) >= n]

    # -- checks ------------------------------------------------------------------------
    def check_take(
        self, slot: int, key: TenantKey, tokens: Sequence[int], n: int, *, what: str, exclude: str = ""
    ) -> Finding | None:
        """A request of tenant ``key`` took cells [0, n) of ``slot``: are they its tenant's, and exact?"""
        if n <= 0:
            return None
        cands = self.candidates(slot, tokens, n, exclude=exclude)
        if not cands:
            self.unexplained.append(f"round {self.round}: {what}: {n} cells of slot {slot}, no holder has those tokens")
            return None
        mine = [h for h in cands if h.key == key]
        if not mine:
            others = sorted({f"{h.key} ({h.origin})" for h in cands})
            return Finding("salt", f"{what}: {n} cells of slot {slot} for {key}, held only by {', '.join(others)}")
        if all(h.exact < n for h in mine):
            exact = max(h.exact for h in mine)
            return Finding("inexact", f"{what}: {n} cells of slot {slot}, only {exact} exact ({mine[0].origin})")
        return None

    def note_promotion(self, source: int, key: TenantKey, tokens: Sequence[int], n: int, exclude: str = "") -> None:
        """A share of ``n`` cells from unreserved ``source`` may have been copied into a reserved pool."""
        self.promoted += [h.truncated(n) for h in self.candidates(source, tokens, n, exclude=exclude)]

    def note_unseen_share(self, tokens: Sequence[int], min_tokens: int = 64) -> None:
        """A request whose answer never came (cancelled) may have shared, and promoted, any prefix of its tokens
        that an agent's slot held."""
        for s in self.slots:
            if s in self.pools:
                continue
            for h in [*self.resident.get(s, []), *self.created.get(s, [])]:
                n = common_prefix_len(h.tokens, tokens)
                if n >= min_tokens:
                    self.promoted.append(h.truncated(n))

    def end_round(self, pools: Mapping[int, PoolView], salts: Iterable[str]) -> list[Finding]:
        """Residents after the round; reserved pools from /slots (matched by hash or MAC, so that a salted prefix
        shown as unsalted is a finding)."""
        findings: list[Finding] = []
        for s in self.slots:
            if s in self.pools:
                continue
            if self.created.get(s):
                self.resident[s] = [h for h in self.created[s] if not h.child]
        salts = list(salts)
        for p in self.pools:
            view = pools.get(p)
            cands = [*self.resident.get(p, []), *self.created.get(p, []), *self.promoted]
            if view is None or not view.resident:
                self.resident[p] = []
                continue
            if view.tokens_sha256 is not None:
                match = [h for h in cands if sha256_of(h.tokens) == view.tokens_sha256]
                if match and all(h.key[0] for h in match):
                    findings.append(
                        Finding("shown_unsalted", f"pool {p} is shown unsalted, its prefix came from {match[0].origin}")
                    )
            else:
                match = [h for h in cands if h.key[0] in salts and mac_of(h.tokens, h.key[0]) == view.tokens_mac]
            if not match and cands:
                self.unexplained.append(f"round {self.round}: pool {p}: /slots names content the ledger lacks ({view})")
            self.resident[p] = list({(h.key, h.tokens, h.exact): h for h in reversed(match)}.values())
        return findings
