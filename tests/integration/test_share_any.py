"""Zero-config sharing (patch 0077, ``--share-any``): no pool declared, the official ``openai`` package.

Every check but the start-up ones and the byte-for-byte one runs on each model family (``family_model``: the default
llama model, and Gemma 3 with sliding-window attention, docs/models.md). The patched server is started as ``polykv
serve`` starts it without ``--pool`` (presets.serve_server: share-any and shared decode on), small: 4 agent slots,
8,192 cells, 2 threads, batches of 128 tokens (so a ~600-token system message takes several passes to prefill and
concurrent requests meet it half computed). The reference server gets the same slots, cells and batch size.

- N concurrent chat requests with one system message and different questions: all but the first report
  ``cached_tokens`` >= the system message's tokens, the server computes at most the first prompt plus the
  others' suffixes (+5%), and the answers equal the reference server's under the layout margins of
  :mod:`polykv_py.harness.compare`; a second turn per agent reuses the agent's whole first prompt;
- promotion: a prefix shared from an agent slot is copied into the reserved pool slot (``polykv serve`` keeps
  slot 0 for that) and is still shared after every agent slot has moved on;
- isolation: the same ``cache_salt`` shares, another salt or none does not (no shared_prefix, 0 cached);
- chaos: the request computing the common prefix is cancelled half-way; the ones waiting for it still answer
  like the reference and the server stays up;
- bad start: without unified KV the server refuses ``--share-any``; with context shift it runs with it off;
- keyless routing: two replicas behind smg's ``cache_aware`` policy send a system message's later plain requests
  to the replica that computed it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from polykv_py.client import ROUTED_WORKER_HEADER, Client
from polykv_py.cluster import Cluster, ClusterConfig
from polykv_py.data import sample_document
from polykv_py.errors import ServerError
from polykv_py.gateway import GatewayOptions
from polykv_py.harness.answers import SHARE_FIELDS, VOLATILE_FIELDS, compare
from polykv_py.harness.compare import compare_chat
from polykv_py.harness.texts import repeat_to_tokens
from polykv_py.llama_server import LlamaServer
from polykv_py.pools import PoolCache
from polykv_py.prefix_file import tokens_sha256
from polykv_py.presets import NO_HOST_CACHE, SHARE_ANY, reference_server, serve_server, slots_args
from polykv_py.tokens import common_prefix_len

pytestmark = pytest.mark.integration

AGENTS = 4
CTX = 8192
BATCH = ("-b", "128", "-ub", "128")
SYSTEM_TOKENS = 600
MAX_TOKENS = 8
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 5}
PROMPT_SLACK = 1.05  # prompt tokens computed may exceed the first prompt + the others' suffixes by 5%


@pytest.fixture(scope="module")
def srv(family_model: Path, logs: Path) -> Iterator[LlamaServer]:
    # LLAMA_SERVER_SLOTS_DEBUG=1: /slots shows each slot's last prompt (unsalted tasks only)
    s = serve_server(0, agent_slots=AGENTS, ctx=CTX, threads=2, extra_args=BATCH, log_dir=logs, name="share-any",
                     model=family_model, env={"LLAMA_SERVER_SLOTS_DEBUG": "1"})  # fmt: skip
    with s.start():
        yield s


@pytest.fixture(scope="module")
def ref(family_model: Path, logs: Path) -> Iterator[LlamaServer]:
    s = reference_server(model=family_model, n_slots=AGENTS, ctx=CTX, threads=2, extra_args=["--metrics", *BATCH],
                         log_dir=logs)  # fmt: skip
    with s.start():
        yield s


@pytest.fixture(scope="module")
def system(srv: LlamaServer) -> str:
    with Client(srv.url) as c:
        return repeat_to_tokens(sample_document(), SYSTEM_TOKENS, c.tokenize, c.detokenize)


def oai(server: LlamaServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def ask(server: LlamaServer, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    resp = oai(server).chat.completions.create(model="m", messages=messages, **GREEDY, **extra)  # type: ignore[call-overload]
    return resp.model_dump()  # type: ignore[no-any-return]


def ask_all(server: LlamaServer, conversations: list[list[dict[str, str]]], **extra: Any) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(conversations)) as ex:
        return list(ex.map(lambda m: ask(server, m, **extra), conversations))


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def computed(server: LlamaServer) -> float:
    with Client(server.url) as c:
        return c.metrics()["llamacpp:prompt_tokens_total"]


def counter(server: LlamaServer, name: str) -> float:
    with Client(server.url) as c:
        return c.metrics().get(f"llamacpp:{name}", 0.0)


def busy_agents(server: LlamaServer) -> int:
    """Agent slots (not reserved pools) with a task."""
    with Client(server.url) as c:
        return sum(bool(s["is_processing"]) and not s.get("polykv_pool") for s in c.slots())


def common_prefix(server: LlamaServer, a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    """Tokens two chat requests' rendered prompts have in common."""
    with Client(server.url) as c:
        ta, tb = (c.prompt_tokens(c.apply_template(m)) for m in (a, b))
    n = 0
    while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
        n += 1
    return n


def assert_same_answers(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        ca, cb = a["choices"][0], b["choices"][0]
        cmp = compare_chat(ca, cb)
        assert cmp.ok, f"agent {i}: {cmp.detail}: {ca['message']['content']!r} vs {cb['message']['content']!r}"


def conversation(system: str, i: int, tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"{tag} {i}: what is point {i}?"}]


def test_concurrent_agents_share_the_system_message_and_compute_it_once(
    srv: LlamaServer, ref: LlamaServer, system: str
) -> None:
    turn1 = [conversation(system, i, "Agent") for i in range(AGENTS)]
    n_sys = common_prefix(srv, turn1[0], turn1[1])
    assert n_sys >= SYSTEM_TOKENS
    before, waits = computed(srv), counter(srv, "polykv_share_waits_total")
    ours = ask_all(srv, turn1)
    spent = computed(srv) - before

    cached_counts = sorted(cached(a) for a in ours)
    assert cached_counts[0] < n_sys, f"one request computes the system message: {cached_counts}"
    assert all(c >= n_sys for c in cached_counts[1:]), f"the others share it ({n_sys} tokens): {cached_counts}"
    sharers = [a for a in ours if cached(a) >= n_sys]
    # from the first request's slot ("any"), or from the pool slot it was promoted into ("pool", --pool-auto)
    assert all(a["shared_prefix"]["auto"] in ("any", "pool") and a["shared_prefix"]["status"] == "hit" for a in sharers)
    prompts = [a["usage"]["prompt_tokens"] for a in ours]
    bound = max(prompts) + sum(p - n_sys for p in prompts)
    assert spent <= bound * PROMPT_SLACK, f"computed {spent} prompt tokens, bound {bound} (+5%)"
    # the requests met the first one's prefill half-done (batches of 128): they waited instead of computing
    assert counter(srv, "polykv_share_waits_total") > waits
    assert any(a["shared_prefix"].get("waited") for a in sharers)

    theirs = ask_all(ref, turn1)
    assert [cached(a) for a in theirs] == [0] * AGENTS  # the stock server computes every prompt
    assert_same_answers(ours, theirs)

    # turn 2 (the same history on both servers): each agent finds its own first prompt again
    turn2 = [
        [*m, {"role": "assistant", "content": a["choices"][0]["message"]["content"]},
         {"role": "user", "content": f"And point {i + 10}?"}]
        for i, (m, a) in enumerate(zip(turn1, ours, strict=True))
    ]  # fmt: skip
    before = computed(srv)
    ours2 = ask_all(srv, turn2)
    assert all(cached(a2) >= a1["usage"]["prompt_tokens"] for a1, a2 in zip(ours, ours2, strict=True)), [
        (a1["usage"]["prompt_tokens"], cached(a2)) for a1, a2 in zip(ours, ours2, strict=True)
    ]
    spent2 = computed(srv) - before
    new_tokens = sum(
        a2["usage"]["prompt_tokens"] - a1["usage"]["prompt_tokens"] for a1, a2 in zip(ours, ours2, strict=True)
    )
    assert spent2 <= new_tokens * 2, f"turn 2 computed {spent2} prompt tokens for {new_tokens} new ones"
    assert_same_answers(ours2, ask_all(ref, turn2))


def test_a_shared_prefix_is_promoted_to_the_pool_and_outlives_the_agents(srv: LlamaServer, system: str) -> None:
    """The first test's system message was shared from an agent slot, so it was copied into the reserved (empty)
    pool slot 0; agents with other prompts then take every agent slot, and the system message is still shared."""
    with Client(srv.url) as c:
        pool = c.slots()[0]
        n_sys = common_prefix(srv, conversation(system, 0, "Agent"), conversation(system, 1, "Agent"))
        assert pool["polykv_pool"] and pool["polykv_pool_state"]["n_tokens"] >= n_sys, pool.get("polykv_pool_state")
        assert c.metrics()["llamacpp:polykv_share_promoted_total"] >= 1
    other_text = "\n".join(f"Ledger line {k}: crate {k * 7 % 31} went to dock {k % 5}." for k in range(40))
    others = [conversation(f"Ledger {i}.\n{other_text}", i, "Other") for i in range(AGENTS)]
    ask_all(srv, others)  # every agent slot now holds another prompt
    with Client(srv.url) as c:
        agent_prompts = [s.get("prompt") or "" for s in c.slots()[1:]]
    assert all(p and system[:200] not in p for p in agent_prompts), "an agent slot still holds the system message"
    late_msgs = conversation(system, 9, "Agent")  # the pool's whole prefix (with SWA only that keeps its window)
    n_late = min(n_sys, common_prefix(srv, late_msgs, conversation(system, 0, "Agent")))
    assert n_late >= SYSTEM_TOKENS
    late = ask(srv, late_msgs)
    assert cached(late) >= n_late and late["shared_prefix"]["pool_slot"] == 0, (
        late["usage"],
        late.get("shared_prefix"),
    )


EXACT: dict[str, Any] = {"temperature": 0, "n_predict": 16, "n_probs": 5, "cache_prompt": True}


def hit(pool_slot: int, shared: int, auto: str) -> dict[str, Any]:
    """The ``shared_prefix`` of a request that shared ``shared`` tokens of ``pool_slot`` by itself."""
    return {"pool_slot": pool_slot, "requested": None, "shared": shared, "status": "hit", "auto": auto}


def test_a_promoted_pool_answers_like_the_reference_byte_for_byte(logs: Path) -> None:
    """A request served from a promoted pool, byte for byte against the reference in the same cell layout.

    Fresh servers, ``--shared-decode`` off (its kernel is not upstream's bit for bit, docs/shared-decode.md).
    Patched: A on slot 1 computes the prefix at cells [0, P); B on slot 2 shares it (``auto: any``) and the
    server promotes it into the reserved pool 0 (the same cells, one more sequence id); slots 1 and 2 are
    erased, so only the pool's cells [0, P) are left, and C (unpinned) shares them (``auto: pool``) with its
    own cells from P on. Reference: A on C's slot, then C on that slot reuses the same P cells, its own from P
    on. A, B and C differ from their first token after P on, so both servers reuse exactly P tokens.
    """
    n_slots = 3
    patched = serve_server(0, agent_slots=n_slots - 1, ctx=4096, threads=2, extra_args=BATCH, log_dir=logs,
                           name="share-any-exact", shared_decode=False, slot_actions=True)  # fmt: skip
    with patched.start(), Client(patched.url) as c:
        base = repeat_to_tokens(sample_document(), SYSTEM_TOKENS, c.tokenize, c.detokenize)
        prompts = [base + q for q in ("\nQuestion A: what is first?\nAnswer:", "\nBy the way B, which is second?",
                                      "\nCould C name the third?\nAnswer:")]  # fmt: skip
        a_tok, b_tok, c_tok = (c.prompt_tokens(p) for p in prompts)
        p = common_prefix_len(a_tok, b_tok)
        assert p >= SYSTEM_TOKENS and common_prefix_len(a_tok, c_tok) == p == common_prefix_len(b_tok, c_tok)
        c.completion(prompts[0], id_slot=1, **EXACT)
        b = c.completion(prompts[1], id_slot=2, **EXACT)
        assert b.get("shared_prefix") == hit(1, p, "any")
        (pool,) = c.pools()
        assert pool.slot == 0 and pool.promoted and pool.resident and pool.n_tokens == p, pool
        assert pool.tokens_sha256 == tokens_sha256(a_tok[:p])
        c.erase_slot(1)
        c.erase_slot(2)
        before = c.metrics()
        mine = c.completion(prompts[2], **EXACT)
        after = c.metrics()
        (pool_after,) = c.pools()
    assert mine.get("shared_prefix") == hit(0, p, "pool")
    assert (mine["timings"]["cache_n"], mine["timings"]["prompt_n"]) == (p, len(c_tok) - p), mine["timings"]
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == len(c_tok) - p
    assert after["llamacpp:polykv_share_promoted_total"] == 1 and pool_after.hits == pool.hits + 1
    assert after["llamacpp:polykv_share_hits_total"] == before["llamacpp:polykv_share_hits_total"] + 1

    slot = mine["id_slot"]
    with reference_server(n_slots=n_slots, ctx=4096, threads=2, extra_args=BATCH, log_dir=logs,
                          name="share-any-exact-reference").start() as ref, Client(ref.url) as rc:  # fmt: skip
        rc.completion(prompts[0], id_slot=slot, **EXACT)
        theirs = rc.completion(prompts[2], id_slot=slot, **EXACT)
    assert theirs["timings"]["cache_n"] == p, "the reference reuses the same P cells"
    same, where = compare(mine, theirs, strip_a=(*VOLATILE_FIELDS, *SHARE_FIELDS))
    assert same, f"the promoted pool's answer differs from the reference's at {where}"


def test_salts_share_only_with_themselves(srv: LlamaServer, system: str) -> None:
    salted = system.replace("Lanternfish", "Salted Lanternfish")  # a system message no earlier test computed
    first = ask(srv, conversation(salted, 0, "Tenant"), extra_body={"cache_salt": "tenant-a"})
    assert cached(first) == 0
    same = ask(srv, conversation(salted, 1, "Tenant"), extra_body={"cache_salt": "tenant-a"})
    n_sys = common_prefix(srv, conversation(salted, 0, "Tenant"), conversation(salted, 1, "Tenant"))
    assert cached(same) >= n_sys  # shared from the first one's slot, or on that slot itself (least cache lost)

    for extra in ({"cache_salt": "tenant-b"}, {}):
        other = ask(srv, conversation(salted, 2, "Tenant"), extra_body=extra)
        # (an unsalted request may reuse the chat header its slot's unsalted cells start with, a few tokens)
        assert cached(other) < 16, f"{extra or 'no salt'}: {other['usage']}"
        assert "shared_prefix" not in other, other.get("shared_prefix")

    # and the unsalted cells computed just now are not shared into the salted tenant either
    # (with SWA, where a slot's own window cells were reused, upstream's SWA handling decides how much of its own
    # cache it keeps: measured 633 of 634 on Gemma 3)
    again = ask(srv, conversation(salted, 3, "Tenant"), extra_body={"cache_salt": "tenant-a"})
    assert cached(again) >= SYSTEM_TOKENS, (again["usage"], again.get("shared_prefix"))


def test_cancelled_leader_waiters_still_answer(srv: LlamaServer, ref: LlamaServer, system: str) -> None:
    """The request computing the common prefix disconnects half-way through its prefill; the waiting ones share
    what it computed, compute the rest, and all answer as the reference does.

    The leader streams with ``return_progress`` (a chunk after each prefill pass), the followers are sent once
    it has computed a pass, and it hangs up once ``/slots`` shows every follower holding a slot, while its last
    progress chunk says the prompt is not done. (Each pass's batch is full of the leader's tokens, so the
    server looks at the followers, and counts them waiting, only when a pass has room.) That it was
    cancelled mid-prefill is read back from the server: the prompt tokens it computed (``/metrics``, less the
    followers' own) stop short of the common prefix, and a follower shared exactly those cells.
    """
    base = system.replace("Lanternfish", "Cancelled Lanternfish") + "\n\n" + system  # ~1,200 tokens: ~10 passes
    leader_msgs = conversation(base, 0, "Leader")
    followers = [conversation(base, i, "Follower") for i in range(1, AGENTS)]
    n_common = common_prefix(srv, leader_msgs, followers[0])
    body = {"model": "m", "messages": leader_msgs, "stream": True, "return_progress": True,
            "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
    progress: list[dict[str, int]] = []  # the leader's prompt_progress chunks, in order
    tokens: list[dict[str, Any]] = []  # any chunk after the prefill (there must be none)
    computing, hang_up = threading.Event(), threading.Event()

    def leader() -> None:
        with httpx.Client(timeout=600) as h, h.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "prompt_progress" not in chunk:
                    tokens.append(chunk)
                    break
                progress.append(chunk["prompt_progress"])
                if progress[-1]["processed"] > progress[-1]["cache"]:
                    computing.set()  # one prefill pass done
                if hang_up.is_set():
                    break
            r.close()

    waits, before = counter(srv, "polykv_share_waits_total"), computed(srv)
    t = threading.Thread(target=leader)
    t.start()
    try:
        assert computing.wait(120), f"the leader's prefill never reported a pass: {progress}"
        with ThreadPoolExecutor(len(followers)) as ex:
            pending = [ex.submit(ask, srv, m) for m in followers]
            deadline = time.monotonic() + 120
            while (busy := busy_agents(srv)) < AGENTS and time.monotonic() < deadline:
                time.sleep(0.05)
            hang_up.set()
            t.join(120)
            ours = [f.result() for f in pending]
    finally:
        hang_up.set()
        t.join(120)
    assert busy == AGENTS, f"only {busy} agent slots were busy when the leader hung up"
    assert not tokens, f"the leader's prefill finished before it hung up: {tokens[0]}"
    last = progress[-1]
    assert last["processed"] < last["total"], f"the leader hung up after its prefill: {progress}"

    # what the server computed: the followers' own tokens, and the leader's up to the cancel
    spent = computed(srv) - before
    leader_cells = progress[0]["cache"] + spent - sum(a["usage"]["prompt_tokens"] - cached(a) for a in ours)
    assert last["processed"] <= leader_cells < n_common, (
        f"cancelled mid-prefill: the leader's slot holds {leader_cells} cells (it reported {last['processed']}), "
        f"the common prefix is {n_common} tokens"
    )
    # one follower took what the leader had computed (and computed the rest), the others at most the common prefix
    shares = sorted((a["shared_prefix"]["shared"], a["shared_prefix"]["status"], cached(a)) for a in ours)
    assert shares[0] == (leader_cells, "hit", leader_cells), (shares, leader_cells)
    assert all(status == "hit" and c == n and n <= n_common for n, status, c in shares), (shares, n_common)
    # the others waited for the first one computing the rest (and then, today, shared only the leader's part from
    # the pool it was promoted into: --pool-auto is tried before the longer prefix that follower's slot holds)
    assert counter(srv, "polykv_share_waits_total") > waits
    assert any(a["shared_prefix"].get("waited") for a in ours), [a["shared_prefix"] for a in ours]
    assert srv.health_state() == "ok"
    assert_same_answers(ours, ask_all(ref, followers))


def test_share_any_needs_unified_kv(patched_server_bin: Path, model_path: Path, logs: Path) -> None:
    args = [*slots_args(2, 2048), *NO_HOST_CACHE, SHARE_ANY]  # one KV stream per slot: no share possible
    s = LlamaServer(patched_server_bin, model_path, args, log_dir=logs, name="share-any-streams", threads=2)
    with pytest.raises(ServerError) as err:
        s.start(timeout=60)
    assert "--share-any needs unified KV" in str(err.value) + s.log_tail()


def test_share_any_is_off_with_context_shift(patched_server_bin: Path, model_path: Path, logs: Path) -> None:
    args = ["-kvu", *slots_args(2, 2048), *NO_HOST_CACHE, SHARE_ANY, "--context-shift"]
    s = LlamaServer(patched_server_bin, model_path, args, log_dir=logs, name="share-any-shift", threads=2)
    with s.start(), Client(s.url) as c:
        assert "polykv" not in c.props()  # the option is off: /props as without it
        assert "no prefix can be shared here (context shift enabled)" in s.log_tail(200)


@pytest.mark.slow
def test_replicas_route_plain_requests_to_the_replica_holding_the_prefix(
    tmp_path_factory: pytest.TempPathFactory, system: str
) -> None:
    """Keyless routing: two replicas (--share-any) behind smg's cache_aware policy, plain openai requests with no
    routing key; each system message's later requests go to the replica that computed it first, and share it."""
    tmp = tmp_path_factory.mktemp("keyless")
    config = ClusterConfig(replicas=2, pools_per_replica=1, agent_slots=3, ctx=8192, threads=1,
                           gateway=GatewayOptions(policy="cache_aware"))  # fmt: skip
    bases = [system.replace("Lanternfish", name) for name in ("Routed Alpha", "Routed Beta")]
    with Cluster(config, pool_cache=PoolCache(tmp / "pools"), log_dir=tmp) as cluster:
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=600)

        def routed(base: str, i: int) -> tuple[str, int, int]:
            raw = client.chat.completions.with_raw_response.create(
                model=cluster.config.alias,
                messages=conversation(base, i, "Routed"),
                **GREEDY,  # type: ignore[arg-type]
            )
            usage = raw.parse().usage
            assert usage is not None and usage.prompt_tokens_details is not None
            return (
                raw.headers[ROUTED_WORKER_HEADER],
                int(usage.prompt_tokens_details.cached_tokens or 0),
                usage.prompt_tokens,
            )

        for base in bases:
            first_replica, first_cached, _ = routed(base, 0)
            assert first_cached < SYSTEM_TOKENS
            with ThreadPoolExecutor(3) as ex:
                later = list(ex.map(routed, [base] * 3, range(1, 4)))
            assert {r for r, _, _ in later} == {first_replica}, (first_replica, later)
            assert all(c >= SYSTEM_TOKENS for _, c, _ in later), later
