"""A randomized oracle for sharing (issue 34): seeded mixed traffic against a real server, every take checked.

:class:`Traffic` turns a seed into rounds of operations that exercise every path cells take into a slot:
requests of several tenants (``cache_salt`` or none, a LoRA adapter applied or not) over common documents,
``n`` 1-3, pairs where a salted ``n`` > 1 request is still generating when another tenant asks over the same
document, chunk reuse (a pinned request with ``n_cache_reuse`` that cuts a paragraph out, moving the chunk
after it) followed by plain requests over the same text, requests cancelled mid-prompt, and between rounds slot
files saved and restored, pools saved and restored, slots erased. Promotion and coalescing happen by themselves.

:func:`run_oracle` sends them to the server (``polykv serve``'s recipe), then for every request that took cells
it did not compute (a share, or its own slot's cache):

- checks the take against the :class:`~polykv_py.harness.ledger.Ledger`, the oracle's own account of what each
  slot may hold (built from the answers' slot ids and the test's knowledge of each request's tenant, not from
  the server's provenance): the cells must be its tenant's and exact;
- compares the answer with a fresh computation of the same request on the reference server
  (:func:`~polykv_py.harness.compare.compare_greedy`, layout margins).

A request that asked for chunk reuse itself is not compared (it asked for approximate cells). The report counts
the operations, the takes and their verdicts; a run passes with no finding and no ``different`` answer.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from ..client import Client
from ..data import sample_document
from ..data.questions import QUESTIONS
from ..errors import PolykvError
from ..tokens import common_prefix_len
from .compare import compare_greedy
from .ledger import ALL, Finding, Holder, Ledger, PoolView, TenantKey

log = logging.getLogger(__name__)

#: Sampling of every request (greedy, with the top candidates the comparison needs).
GREEDY: dict[str, Any] = {"temperature": 0, "n_probs": 5, "cache_prompt": True, "return_tokens": True}
#: The servers' one adapter (``--lora``, default scale 1), applied or not by a request's ``lora`` field.
LORA_ON = [{"id": 0, "scale": 1.0}]
LORA_OFF = [{"id": 0, "scale": 0.0}]

LoraField = Literal["default", "on", "off"]


@dataclass(frozen=True)
class Tenant:
    """Who sends a request: its ``cache_salt`` (None: the OpenAI default, no salt) and its ``lora`` field: none
    (``default``: the server's own adapter set, which ``--lora`` applies at scale 1 even with
    ``--lora-init-without-apply``), the adapter at scale 1 (``on``) or at 0 (``off``)."""

    salt: str | None = None
    lora: LoraField = "default"

    @property
    def key(self) -> TenantKey:
        return (self.salt or "", self.lora != "off")  # default and on compute the same cells

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.salt:
            out["cache_salt"] = self.salt
        if self.lora != "default":
            out["lora"] = LORA_ON if self.lora == "on" else LORA_OFF
        return out


@dataclass(frozen=True)
class Deleted:
    """Chunk-reuse texts: ``filler + fact + ask`` computed first, then ``filler + ask`` reuses the moved ``ask``.
    Cells of ``ask`` computed after ``fact`` answer with the fact; an exact computation does not know it."""

    filler: str
    fact: str
    ask: str


_FILLER = "Numbers: " + ", ".join(str(i * 7) for i in range(25)) + ".\n\n"
DELETED = (
    Deleted(_FILLER, "The capital of Zorbania is Quexville. " * 8 + "\n\n",
            "Q: What is the capital of Zorbania?\nA: The capital of Zorbania is"),
    Deleted(_FILLER, "My name is Bartholomew Quince. " * 8 + "\n\n", "Q: What is my name?\nA: Your name is"),
    Deleted(_FILLER, "The door code is 7 3 9 1. " * 8 + "\n\n", "Q: What is the door code?\nA: The door code is"),
)  # fmt: skip

OpKind = Literal["ask", "reuse", "follow", "cancel"]
#: The scenario rolls of the first rounds: a salted n > 1 pair, a chunk reuse, a cancel, a coalescing group.
FIRST_ROLLS = (0.1, 0.4, 0.75, 0.9)
AdminKind = Literal["erase", "slot_file", "pool_file"]


@dataclass
class Op:
    """One concurrent operation of a round."""

    kind: OpKind
    tenant: Tenant
    prompt: str
    n: int = 1
    n_predict: int = 8
    delay: float = 0.0
    slot: int | None = None  # pinned (id_slot)
    first: str = ""  # reuse: the prompt computed before on the same slot
    then: Tenant | None = None  # reuse: who sends the same text next, plainly (a follow-up)


@dataclass
class Admin:
    """One action between rounds."""

    kind: AdminKind
    slot: int
    dst: int | None = None


@dataclass
class Round:
    ops: list[Op]
    admin: list[Admin]


def documents() -> list[str]:
    """Three documents of a few hundred tokens (sections of the sample design document)."""
    parts = [p for p in sample_document().split("\n## ") if len(p) > 600]
    return ["## " + p[:1100] for p in parts[:3]]


class Traffic:
    """The seeded generator of rounds (see the module docstring)."""

    def __init__(self, seed: int, *, agent_slots: Sequence[int], pools: Sequence[int], lora: bool) -> None:
        self.rng = random.Random(seed)
        self.agent_slots = list(agent_slots)
        self.pools = list(pools)
        salts = (None, "tenant-a-4e1d", "tenant-b-90c2")
        self.tenants = [Tenant(s) for s in salts]
        if lora:  # the servers load an adapter: tenants that turn it off, or name it at its default scale
            self.tenants += [Tenant(None, "off"), Tenant(salts[1], "off"), Tenant(None, "on")]
        self.docs = documents()
        self.reused: list[tuple[Tenant, Deleted]] = []  # chunk reuses done: later rounds follow them up
        self.n = 0

    @property
    def salts(self) -> list[str]:
        return sorted({t.salt for t in self.tenants if t.salt})

    def _ask(self, tenant: Tenant | None = None, *, n: int = 1, n_predict: int = 8, delay: float = 0.0) -> Op:
        q = self.rng.choice(QUESTIONS)[0]
        prompt = self.rng.choice(self.docs) + f"\n\nQuestion: {q}\nAnswer:"
        return Op("ask", tenant or self.rng.choice(self.tenants), prompt, n=n, n_predict=n_predict, delay=delay)

    def _tenant(self, *, not_key: TenantKey | None = None) -> Tenant:
        """A tenant, half the time the OpenAI default (no salt, no lora field): most real traffic."""
        pick = [t for t in self.tenants if t.key != not_key]
        default = Tenant()
        if default in pick and self.rng.random() < 0.5:
            return default
        return self.rng.choice(pick)

    def round(self) -> Round:
        """One scenario (a risk the round is about) and a background request or two, all at once. The first
        rounds take each scenario once, so that every seed exercises all of them."""
        rng, self.n = self.rng, self.n + 1
        free = list(self.agent_slots)
        rng.shuffle(free)
        ops: list[Op] = []
        roll = rng.random() if self.n > len(FIRST_ROLLS) else FIRST_ROLLS[self.n - 1]
        if roll < 0.3:  # a salted n > 1 request still generating when another tenant asks over the same document
            salted = rng.choice([t for t in self.tenants if t.salt])
            n = rng.choice((2, 3))
            first = self._ask(salted, n=n, n_predict=48)
            second = self._ask(self._tenant(not_key=salted.key), delay=rng.uniform(0.8, 2.0))
            second.prompt = first.prompt.rsplit("\nQuestion:", 1)[0] + f"\n\nQuestion: {rng.choice(QUESTIONS)[0]}"
            ops += [first, second]
            del free[: n + 1]
        elif roll < 0.6:  # chunk reuse on a pinned slot, then a plain request over the moved text
            d, t = rng.choice(DELETED), self._tenant()
            who = t if rng.random() < 0.7 else self._tenant()
            ops.append(Op("reuse", t, d.filler + d.ask, slot=free.pop(), first=d.filler + d.fact + d.ask, then=who))
            self.reused.append((t, d))
            free.pop()
        elif roll < 0.7 and self.reused:  # an earlier chunk reuse, followed up later
            t, d = rng.choice(self.reused)
            ops.append(Op("follow", t if rng.random() < 0.7 else self._tenant(), d.filler + d.ask))
            free.pop()
        elif roll < 0.8:  # cancelled mid-prompt
            doc = rng.choice(self.docs)
            ops.append(Op("cancel", self._tenant(), doc * 3, slot=free.pop(), delay=rng.uniform(0, 0.5)))
        else:  # requests over one document at once: coalescing, concurrent shares
            t = self._tenant()
            doc = rng.choice(self.docs)
            for i in range(3):
                ask = self._ask(t if i < 2 else self._tenant(), delay=rng.uniform(0, 0.3))
                ask.prompt = doc + ask.prompt[ask.prompt.index("\n\nQuestion:") :]
                ops.append(ask)
                free.pop()
        for _ in range(rng.randint(0, min(2, len(free)))):  # background
            ops.append(self._ask(self._tenant(), n=rng.choice((1, 1, 2)) if len(free) >= 2 else 1))
            free.pop()
        admin: list[Admin] = []
        if rng.random() < 0.25:
            src, dst = rng.sample(self.agent_slots, 2)
            admin.append(Admin("slot_file", src, dst))
        if rng.random() < 0.25 and self.pools:
            admin.append(Admin("pool_file", rng.choice(self.pools)))
        if rng.random() < 0.2:
            admin.append(Admin("erase", rng.choice(self.agent_slots + self.pools)))
        return Round(ops, admin)


@dataclass
class Call:
    """One request the oracle sent."""

    id: str
    op: Op
    prompt: str
    exempt: bool = False  # asked for chunk reuse: approximate cells by its own request
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    exact: int = ALL  # for the holder it leaves (a chunk reuse that moved cells: the common prefix)


@dataclass
class OracleReport:
    """What a run did and found."""

    seed: int
    rounds: int
    ops: Counter[str] = field(default_factory=Counter)  # requests per operation kind
    admin: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    shares: int = 0
    shares_by: Counter[str] = field(default_factory=Counter)
    own_cache_takes: int = 0
    compared: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)
    different: list[str] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # one line per request: what it was and what it took
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.findings and not self.different

    def to_json(self) -> dict[str, Any]:
        # (asdict would rebuild each Counter from its items, counting the pairs)
        out = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}
        out["findings"] = [asdict(f) for f in self.findings]
        out["ok"] = self.ok
        return out

    def summary(self) -> str:
        kinds = Counter(f.kind for f in self.findings)
        return (
            f"seed {self.seed}, {self.rounds} rounds, {self.requests} requests ({dict(self.ops)}), "
            f"{self.shares} shares, {self.own_cache_takes} own-cache takes, {self.compared} answers compared "
            f"({dict(self.verdicts)}), findings {dict(kinds) or 0}, unexplained {len(self.unexplained)}, "
            f"{self.wall_s:.0f} s"
        )


class _Reference:
    """Fresh computations on the reference server, cached per (prompt, tenant's LoRA, n_predict)."""

    def __init__(self, url: str) -> None:
        self.client = Client(url, timeout=600)
        self.cache: dict[tuple[str, bool, int], dict[str, Any]] = {}

    def answer(self, prompt: str, tenant: Tenant, n_predict: int) -> dict[str, Any]:
        k = (prompt, tenant.key[1], n_predict)
        if k not in self.cache:
            self.client.erase_slot(0)
            params: dict[str, Any] = {"id_slot": 0, "n_predict": n_predict, **GREEDY}
            if "lora" in tenant.fields():
                params["lora"] = tenant.fields()["lora"]
            self.cache[k] = self.client.completion(prompt, **params)
        return self.cache[k]


class _Runner:
    def __init__(self, url: str, reference: str, traffic: Traffic, report: OracleReport) -> None:
        self.url = url
        self.c = Client(url, timeout=600)
        self.ref = _Reference(reference)
        self.traffic = traffic
        self.report = report
        self.ledger = Ledger(slots=[*traffic.pools, *traffic.agent_slots], pools=traffic.pools)
        self.tokens: dict[str, list[int]] = {}
        self.n_calls = 0
        self.lock = threading.Lock()

    def toks(self, prompt: str) -> list[int]:
        if prompt not in self.tokens:
            self.tokens[prompt] = self.c.prompt_tokens(prompt)
        return self.tokens[prompt]

    def _call(self, op: Op, prompt: str, **extra: Any) -> Call:
        with self.lock:
            self.n_calls += 1
            call = Call(f"r{self.traffic.n}-{self.n_calls}-{op.kind}", op, prompt, exempt="n_cache_reuse" in extra)
        body = {"n_predict": op.n_predict, **GREEDY, **op.tenant.fields(), **extra}
        if op.n > 1:
            body["n_cmpl"] = op.n
        if op.slot is not None:
            body["id_slot"] = op.slot
        with Client(self.url, timeout=600) as c:
            res = c.completion(prompt, **body)
        call.results = res if isinstance(res, list) else [res]
        return call

    def run_op(self, op: Op) -> list[Call]:
        time.sleep(op.delay)
        try:
            if op.kind == "reuse":
                first = self._call(op, op.first)
                moved = self._call(op, op.prompt, n_cache_reuse=8)
                n_common = common_prefix_len(self.toks(op.first), self.toks(op.prompt))
                if moved.results[0]["timings"]["prompt_n"] < len(self.toks(op.prompt)) - n_common:
                    moved.exact = n_common  # the chunk after the common prefix was moved into place
                calls = [first, moved]
                if op.then is not None:
                    calls.append(self._call(Op("follow", op.then, op.prompt), op.prompt))
                return calls
            if op.kind == "cancel":
                return [self._cancel(op)]
            return [self._call(op, op.prompt)]
        except (PolykvError, httpx.HTTPError) as exc:
            return [Call(f"r{self.traffic.n}-err-{op.kind}", op, op.prompt, error=str(exc))]

    def _cancel(self, op: Op) -> Call:
        call = Call(f"r{self.traffic.n}-cancel-{op.slot}", op, op.prompt, exempt=True)
        body = {"prompt": op.prompt, "n_predict": 4, **GREEDY, **op.tenant.fields(), "id_slot": op.slot}
        try:
            httpx.post(self.url + "/completion", json=body, timeout=httpx.Timeout(5.0, read=0.4), trust_env=False)
        except httpx.TimeoutException:
            call.error = "cancelled"  # the server drops the task when the connection closes
        return call

    # -- one round -----------------------------------------------------------------
    def round(self, rnd: Round) -> None:
        self.ledger.begin_round()
        calls: list[Call] = []
        threads = [threading.Thread(target=lambda o=op: calls.extend(self.run_op(o))) for op in rnd.ops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for call in calls:
            self._record(call)
        for call in calls:  # first every promotion (a pool a later share of this round reads may hold one)
            self._note_promotion(call)
        for call in calls:
            self._check(call)
        slots = self.c.slots()
        pools = {s["id"]: PoolView.from_slot(s["polykv_pool_state"]) for s in slots if s.get("polykv_pool_state")}
        self.report.findings += self.ledger.end_round(pools, self.traffic.salts)
        for a in rnd.admin:
            self._admin(a)

    def _record(self, call: Call) -> None:
        self.report.ops[call.op.kind] += 1
        if call.error and call.error != "cancelled":
            self.report.errors.append(f"{call.id}: {call.error}")
            return
        self.report.requests += 1
        toks = self.toks(call.prompt)
        if call.error == "cancelled":  # mid-prompt: some prefix of its prompt
            self.ledger.add(int(call.op.slot or 0), Holder(call.op.tenant.key, tuple(toks), origin=call.id))
            return
        for i, res in enumerate(call.results):
            held = tuple(toks + list(res.get("tokens") or []))
            holder = Holder(call.op.tenant.key, held, exact=call.exact, child=i > 0, origin=call.id)
            self.ledger.add(int(res["id_slot"]), holder)

    @staticmethod
    def _share(call: Call) -> dict[str, Any]:
        sp = (call.results[0].get("shared_prefix") or {}) if call.results and not call.error else {}
        return sp if sp.get("status") in ("hit", "copied") else {}

    def _note_promotion(self, call: Call) -> None:
        if call.error == "cancelled":
            self.ledger.note_unseen_share(self.toks(call.prompt))
            return
        sp = self._share(call)
        if sp and int(sp["pool_slot"]) not in self.traffic.pools:
            toks = self.toks(call.prompt)
            self.ledger.note_promotion(int(sp["pool_slot"]), call.op.tenant.key, toks, int(sp["shared"]), call.id)

    def _check(self, call: Call) -> None:
        if call.error or not call.results:
            return
        res0, key, toks = call.results[0], call.op.tenant.key, self.toks(call.prompt)
        sp = self._share(call)
        slots = [r["id_slot"] for r in call.results]
        t = res0["timings"]
        self.report.log.append(
            f"{call.id} {key} slots {slots} pinned {call.op.slot} n_prompt {len(toks)} cache_n {t['cache_n']}"
            f" prompt_n {t['prompt_n']} share {sp or res0.get('shared_prefix')} exact {call.exact}"
        )
        took = 0
        if sp:
            took, src = int(sp["shared"]), int(sp["pool_slot"])
            self.report.shares += 1
            self.report.shares_by[str(sp.get("auto", "named"))] += 1
            self._finding(self.ledger.check_take(src, key, toks, took, what=f"{call.id} share", exclude=call.id))
        elif not call.exempt and int(res0["timings"]["cache_n"]) > 0:
            took = int(res0["timings"]["cache_n"])
            self.report.own_cache_takes += 1
            slot = int(res0["id_slot"])
            what = f"{call.id} own cache"
            self._finding(self.ledger.check_take(slot, key, toks, took, what=what, exclude=call.id))
        if took == 0 or call.exempt:
            return
        ref = self.ref.answer(call.prompt, call.op.tenant, call.op.n_predict)
        for i, res in enumerate(call.results):
            cmp = compare_greedy(res, ref)
            self.report.compared += 1
            self.report.verdicts[cmp.verdict] += 1
            if not cmp.ok:
                self.report.different.append(f"{call.id} choice {i} (took {took}, {sp or 'own cache'}): {cmp.detail}")

    def _finding(self, f: Finding | None) -> None:
        if f is not None:
            log.warning("oracle finding: %s %s", f.kind, f.detail)
            self.report.findings.append(f)

    def _admin(self, a: Admin) -> None:
        self.report.admin[a.kind] += 1
        try:
            if a.kind == "erase":
                self.c.erase_slot(a.slot)
                self.ledger.set_resident(a.slot, [])
            elif a.kind == "slot_file" and a.dst is not None:
                name = f"oracle-slot-{self.traffic.n}.bin"
                self.c.request("POST", f"/slots/{a.slot}?action=save", {"filename": name})
                self.c.request("POST", f"/slots/{a.dst}?action=restore", {"filename": name})
                self.ledger.set_resident(a.dst, self.ledger.resident.get(a.slot, []))
            elif a.kind == "pool_file":
                self._pool_file(a.slot)
        except PolykvError as exc:
            self.report.errors.append(f"admin {a.kind} {a.slot}: {exc}")

    def _pool_file(self, pool: int) -> None:
        """Save the pool under the salt it takes (each wrong one is refused with no detail), erase, restore."""
        name = f"oracle-pool-{self.traffic.n}.pkvpool"
        for salt in (None, *self.traffic.salts):
            try:
                self.c.save_pool(pool, name, cache_salt=salt)
            except PolykvError:
                continue
            held = self.ledger.resident.get(pool, [])
            if held and all(h.key[0] != (salt or "") for h in held):
                origins = ", ".join(sorted({h.origin for h in held}))
                self._finding(Finding("salt", f"pool {pool} saved under salt {salt!r}, its content is {origins}'s"))
            self.c.erase_slot(pool)
            self.c.restore_pool(pool, name, cache_salt=salt)
            return


def run_oracle(url: str, reference_url: str, *, seed: int, rounds: int, agent_slots: Sequence[int],
               pools: Sequence[int], lora: bool) -> OracleReport:  # fmt: skip
    """Run ``rounds`` rounds of seeded traffic against the server at ``url`` (see the module docstring)."""
    traffic = Traffic(seed, agent_slots=agent_slots, pools=pools, lora=lora)
    report = OracleReport(seed=seed, rounds=rounds)
    runner = _Runner(url, reference_url, traffic, report)
    t0 = time.monotonic()
    for _ in range(rounds):
        runner.round(traffic.round())
    report.unexplained = list(runner.ledger.unexplained)
    report.wall_s = time.monotonic() - t0
    log.info("oracle: %s", report.summary())
    return report


def report_json(report: OracleReport) -> str:
    return json.dumps(report.to_json(), indent=1, default=str)
