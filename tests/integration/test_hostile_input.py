"""Hostile input for the shared KV pool, property-based (hypothesis), against one real patched server.

The server is started once for the module (4 slots, unified KV, -c 2048, the default model) and its
slot 0 primed with a short base text: the pool. Every example then erases the other slots and
re-primes the pool (a cached prompt: one token is evaluated), so what the server must answer is known
exactly, and the tests compare it with a model of the patch's decision order (docs/shared-prefix.md):

    no shared_prefix field       shared_pool_slot absent, null or -1
    400 naming the field         shared_pool_slot names a slot that --pool-slots does not reserve
    skipped                      the prompt has no tokens
    no_prefix                    min(P, n_prompt) == 0 (P not given: nothing in common)
    self                         the request runs on the pool slot itself
    mismatch (common)            P not given: fewer than 64 tokens in common, covering neither side
    pool_busy                    the pool slot is processing
    not_resident                 the pool does not hold min(P, n_prompt) tokens (slots 1-3 are erased)
    mismatch (common)            the pool's tokens [0, P) differ from the prompt's
    hit (shared)                 otherwise; shared = P, or P - 1 when P covers the whole prompt

Invariants checked on every example: no HTTP status >= 500; the server process is alive and
/health answers 200 afterwards; a 400 names the offending field; a hit only ever shares tokens the
request itself presents (its first ``shared`` tokens, by /tokenize, equal the pool's).

The one 5xx the server gives is for bodies that are not JSON at all (NaN, Infinity, 1e400, a lone
UTF-16 surrogate, truncated JSON): upstream llama-server answers its JSON parser's exception with
HTTP 500 before any field is read (the reference server does the same). That is pinned down in
``test_malformed_json_is_upstreams_500_and_harmless``.

Set POLYKV_RELIABILITY_OUT=path.json to get the examples tried and outcomes seen per property.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polykv_py.client import Client, error_message
from polykv_py.errors import PolykvError
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import pool_server
from polykv_py.tokens import common_prefix_len

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # hypothesis: hundreds of requests against one server

N_SLOTS = 4
POOL = 0
SHARER = 1  # every sharer is pinned here, erased before each example (its own cache is empty)
INT32_MAX = 2**31 - 1
AUTO_MIN = 64  # --pool-auto-min-tokens default: automatic P on a named pool needs this much in common
FIELDS = ("shared_pool_slot", "shared_prefix_n_tokens")
ENDPOINTS = ("/completion", "/v1/completions", "/v1/chat/completions")
BASE = "Pool notes: the red kite nests by the mill, and the old bridge was rebuilt in 1843.\n"
STATUSES = {
    "no_prefix",
    "self",
    "own_cache",
    "unsupported",
    "pool_busy",
    "not_resident",
    "mismatch",
    "hit",
    "copied",
    "skipped",
}

#: examples tried and outcomes seen, per property (written to $POLYKV_RELIABILITY_OUT at the end)
STATS: dict[str, Counter[str]] = {}


def common_settings(n: int) -> Any:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def tally(prop: str, outcome: str) -> None:
    STATS.setdefault(prop, Counter())[outcome] += 1


@dataclass
class Pool:
    server: LlamaServer
    http: httpx.Client
    client: Client
    tokens: list[int]
    n_vocab: int
    seen_5xx: list[str] = field(default_factory=list)

    def post(self, path: str, body: Any) -> httpx.Response:
        resp = self.http.post(path, json=body)
        if resp.status_code >= 500:
            self.seen_5xx.append(f"{path} {body!r} -> {resp.status_code} {resp.text[:200]}")
        return resp

    def reset(self, prime: bool = True) -> None:
        """Empty the non-pool slots; (re-)prime the pool with exactly the base's tokens."""
        for slot in range(N_SLOTS):
            if slot != POOL:
                self.client.erase_slot(slot)
        if prime:
            self.client.prime(BASE, POOL)

    def alive(self) -> None:
        assert self.server.is_alive(), self.server.log_tail()
        assert self.http.get("/health").status_code == 200

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        """The tokens the server evaluates for this request (chat: its template, then tokenized)."""
        if path == "/v1/chat/completions":
            return self.client.prompt_tokens(self.client.apply_template(body["messages"]))
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else self.client.prompt_tokens(prompt)


@pytest.fixture(scope="module")
def pool(patched_server_bin: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    logs = tmp_path_factory.mktemp("hostile-logs")
    # the pool server's recipe, slot 0 reserved; one thread: prompts here are a few dozen tokens, and with
    # two, ggml's thread barriers stall badly whenever another process competes for the two cores (README,
    # engine benchmark)
    server = pool_server(binary=patched_server_bin, model=model_path, n_agents_parallel=N_SLOTS - 1, ctx=2048,
                         threads=1, track_kv=False, pool_slot=POOL, log_dir=logs, name="hostile")  # fmt: skip
    with (
        server as srv,
        httpx.Client(
            base_url=srv.url, timeout=120, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)
        ) as http,
    ):
        n_vocab = srv.client.get_json("/v1/models")["data"][0]["meta"]["n_vocab"]
        p = Pool(srv, http, srv.client, srv.client.prompt_tokens(BASE), n_vocab)
        p.reset()
        yield p
        assert not p.seen_5xx, p.seen_5xx
        p.alive()
    out = os.environ.get("POLYKV_RELIABILITY_OUT")
    if out:
        write_summary(
            Path(out),
            {f"hostile_{k}_examples": sum(v.values()) for k, v in STATS.items()}
            | {f"hostile_{k}_outcomes": dict(v) for k, v in STATS.items()},
        )


def write_summary(path: Path, entries: dict[str, Any]) -> None:
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc.update(entries)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- the model


def valid_pool_slot(v: Any) -> bool:
    # with --pool-slots only the reserved slot may be named (patch 0074): slots 1-3 are a 400 too
    return v is None or (type(v) is int and v in (-1, POOL))


def valid_prefix(v: Any) -> bool:
    return v is None or (type(v) is int and 0 <= v <= INT32_MAX)


def expected_share(
    pool: list[int], prompt: list[int], pool_slot: int | None, p: int | None, slot: int, busy: bool = False
) -> dict[str, Any] | None:
    """What the patched server reports, given that slots 1-3 are erased and the pool holds ``pool``.

    ``p`` None: P not given, so the server computes it (patch 0074): the common prefix, capped at
    ``len(prompt) - 1``; fewer than AUTO_MIN tokens in common that do not cover the pool or the prompt
    is a mismatch (the pool holds another base).
    """
    if pool_slot is None or pool_slot < 0:
        return None
    auto = p is None
    out: dict[str, Any] = {"pool_slot": pool_slot, "requested": None if auto else p, "shared": 0}
    if auto:
        out["auto"] = "prefix"
    if not prompt:
        return out | {"status": "skipped"}
    common = common_prefix_len(pool, prompt)
    if auto:
        n_req = min(common, len(prompt) - 1)
    else:
        n_req = min(p or 0, len(prompt))
        if n_req <= 0:
            return out | {"status": "no_prefix"}
    if pool_slot == slot:
        return out | {"status": "self"}
    if auto:
        if n_req <= 0:
            return out | {"status": "no_prefix"}
        if common < AUTO_MIN and common < len(pool) - 1 and common < len(prompt) - 1:
            return out | {"status": "mismatch", "common": common}
    if busy:
        return out | {"status": "pool_busy"}
    if n_req > len(pool):
        return out | {"status": "not_resident"}
    if common < n_req:
        return out | {"status": "mismatch", "common": common}
    return out | {"status": "hit", "shared": n_req - 1 if n_req == len(prompt) else n_req}


def check_answer(
    pool: Pool, path: str, body: dict[str, Any], resp: httpx.Response, slot: int, busy: bool = False
) -> str:
    """Check one 200 answer against the model and the isolation invariant; returns its status."""
    assert resp.status_code == 200, resp.text[:500]
    doc = resp.json()
    prompt = pool.prompt_tokens(path, body)
    want = expected_share(
        pool.tokens, prompt, body.get("shared_pool_slot"), body.get("shared_prefix_n_tokens"), slot, busy
    )
    got = doc.get("shared_prefix")
    if want is None:
        assert got is None, got
        return "no field"
    assert got == want, (got, want, len(prompt), len(pool.tokens))
    if got["status"] in ("hit", "copied"):
        n = got["shared"]
        assert 0 < n <= len(prompt) and prompt[:n] == pool.tokens[:n]  # only tokens the request presents
        assert doc["timings"]["prompt_n"] == len(prompt) - n
    elif got["status"] in ("no_prefix", "pool_busy", "not_resident", "mismatch"):
        assert doc["timings"]["prompt_n"] == len(prompt)  # an erased slot, nothing shared: computed in full
    return str(got["status"])


def request_body(path: str, prompt: str | list[int], fields: dict[str, Any], slot: int | None = SHARER) -> dict:
    body: dict[str, Any] = {"temperature": 0, "cache_prompt": True}
    if path == "/v1/chat/completions":
        body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    else:
        body |= {"prompt": prompt, "n_predict": 1} if path == "/completion" else {"prompt": prompt, "max_tokens": 1}
    if slot is not None:
        body["id_slot"] = slot
    return body | fields


# ----------------------------------------------------------------------------- strategies

ANY_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
NOT_INTEGERS = st.one_of(
    ANY_TEXT,
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1.0, 2.0, 1e308, -1e308, 2.0**31, 2.0**63, 1e-300]),
    st.booleans(),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
)
HUGE = st.one_of(
    st.sampled_from(
        [2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 2**200, -(2**31) - 1, -(2**63), -(2**64), -(10**30)]
    ),
    st.integers(min_value=2**31),
    st.integers(max_value=-(2**31)),
)
BAD_POOL_SLOT = st.one_of(NOT_INTEGERS, HUGE, st.integers(max_value=-2), st.integers(min_value=N_SLOTS))
BAD_PREFIX = st.one_of(NOT_INTEGERS, HUGE, st.integers(max_value=-1))


def mix(valid: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Half valid, a quarter null, a quarter invalid (st.one_of would weight each of the many bad
    branches like the one valid branch)."""
    return st.integers(0, 3).flatmap(lambda k: st.none() if k == 0 else bad if k == 1 else valid)


ANY_POOL_SLOT = mix(st.integers(-1, N_SLOTS - 1), BAD_POOL_SLOT)
ANY_PREFIX = mix(st.one_of(st.integers(0, 64), st.integers(0, INT32_MAX), st.just(INT32_MAX)), BAD_PREFIX)
SPECIAL = st.sampled_from(
    ["", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n\n", " ", "\t", "\x00", "\u200b", "Pool notes:", "🦀"]
)
HEADS = st.sampled_from(["", BASE, BASE[:40], BASE[:-1], BASE + "\n", BASE + "\n\n", BASE.upper(), " " + BASE])
SUFFIX = st.text(st.characters(codec="utf-8"), max_size=12)
PROMPTS = st.builds(lambda h, s, x: h + s + x, HEADS, SPECIAL, SUFFIX)


# ----------------------------------------------------------------------------- properties


@common_settings(60)
@given(path=st.sampled_from(ENDPOINTS), name=st.sampled_from(FIELDS), data=st.data())
def test_bad_field_values_are_400_naming_the_field(pool: Pool, path: str, name: str, data: st.DataObject) -> None:
    value = data.draw(BAD_POOL_SLOT if name == "shared_pool_slot" else BAD_PREFIX, label=name)
    fields = {"shared_pool_slot": POOL, "shared_prefix_n_tokens": 4, name: value}
    resp = pool.post(path, request_body(path, BASE + "Q?", fields))
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    message = error_message(resp.content)
    assert message.startswith(f"Field '{name}': "), message
    tally("bad_fields", f"400 {name}")
    pool.alive()


@common_settings(50)
@given(path=st.sampled_from(ENDPOINTS), pool_slot=ANY_POOL_SLOT, prefix=ANY_PREFIX, prompt=PROMPTS)
def test_any_field_values(pool: Pool, path: str, pool_slot: Any, prefix: Any, prompt: str) -> None:
    """Valid or not, any JSON value: 400 exactly when a field is invalid (naming one that is), else the
    model's status (null counts as not given)."""
    pool.reset()
    body = request_body(path, prompt, dict(zip(FIELDS, (pool_slot, prefix), strict=True)))  # None: JSON null
    resp = pool.post(path, body)
    bad = [
        k
        for k, v in zip(FIELDS, (pool_slot, prefix), strict=True)
        if not (valid_pool_slot(v) if k == FIELDS[0] else valid_prefix(v))
    ]
    if bad:
        assert resp.status_code == 400, (resp.status_code, resp.text[:300])
        message = error_message(resp.content)
        assert any(message.startswith(f"Field '{k}': ") for k in bad), (message, bad)
        tally("any_fields", "400")
    else:
        tally("any_fields", check_answer(pool, path, body, resp, SHARER))
    pool.alive()


@common_settings(50)
@given(prompt=PROMPTS, data=st.data())
def test_random_prompts_share_only_their_own_tokens(pool: Pool, prompt: str, data: st.DataObject) -> None:
    """Random text (often starting like the pool), P anywhere from 0 to 2^31-1, drawn often at the
    boundaries (the common prefix, the pool's length, the prompt's length, +-1) and within the common prefix,
    or not given at all (the server computes it)."""
    pool.reset()
    toks = pool.client.prompt_tokens(prompt)
    common = common_prefix_len(pool.tokens, toks)
    edges = sorted({max(0, n + d) for n in (common, len(pool.tokens), len(toks)) for d in (-1, 0, 1)})
    p = data.draw(
        st.one_of(
            st.none(),  # P not given: the server's P must be the true common prefix, capped (patch 0074)
            st.sampled_from(edges),
            st.integers(0, max(0, min(common, len(toks)))),
            st.integers(0, INT32_MAX),
        ),
        label="P",
    )
    path = data.draw(st.sampled_from(("/completion", "/v1/completions")), label="path")
    body = request_body(path, prompt, {"shared_pool_slot": POOL, "shared_prefix_n_tokens": p})
    tally("random_prompts", check_answer(pool, path, body, pool.post(path, body), SHARER))
    pool.alive()


@common_settings(40)
@given(data=st.data())
def test_prompt_matching_the_pool_for_p_minus_1_tokens_is_a_mismatch(pool: Pool, data: st.DataObject) -> None:
    """Token prompts equal to the pool's first P-1 tokens, then a different token (then anything):
    refused with common == P-1, computed in full, never a hit."""
    pool.reset()
    n_pool = len(pool.tokens)
    p = data.draw(st.integers(1, n_pool), label="P")
    other = data.draw(st.integers(0, pool.n_vocab - 1).filter(lambda t: t != pool.tokens[p - 1]), label="token")
    tail = data.draw(st.lists(st.integers(0, pool.n_vocab - 1), max_size=6), label="tail")
    prompt = [*pool.tokens[: p - 1], other, *tail]
    body = request_body("/completion", prompt, {"shared_pool_slot": POOL, "shared_prefix_n_tokens": p})
    resp = pool.post("/completion", body)
    status = check_answer(pool, "/completion", body, resp, SHARER)
    sp = resp.json()["shared_prefix"]
    assert status == "mismatch" and sp["common"] == p - 1 and sp["shared"] == 0, sp
    assert resp.json()["timings"]["prompt_n"] == len(prompt)
    tally("p_minus_1", status)
    pool.alive()


@common_settings(20)
@given(suffix=SUFFIX, p=st.one_of(st.none(), st.integers(1, 64), st.integers(1, INT32_MAX)))
def test_pool_equal_to_own_slot_is_self(pool: Pool, suffix: str, p: int | None) -> None:
    """id_slot == shared_pool_slot (a request pinned to the pool, the only slot it may name): the
    request uses that slot's own cache and shares nothing."""
    pool.reset()
    body = request_body(
        "/completion", BASE + suffix, {"shared_pool_slot": POOL, "shared_prefix_n_tokens": p}, slot=POOL
    )
    status = check_answer(pool, "/completion", body, pool.post("/completion", body), POOL)
    assert status == "self"
    tally("self", status)
    pool.alive()


class BusyPool:
    """A long generation pinned to the pool slot, streamed, stopped by closing its connection."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.errors: list[str] = []
        self.started = 0

    def _run(self) -> None:
        body = {
            "prompt": BASE + "Tell a very long story:",
            "id_slot": POOL,
            "n_predict": 1500,
            "ignore_eos": True,
            "temperature": 0,
        }
        with Client(self.pool.server.url) as c:
            events = c.stream_events("/completion", body)
            try:
                for _ in events:
                    if self.stop.is_set():
                        break
            except PolykvError as exc:
                self.errors.append(str(exc).splitlines()[0])
            finally:
                events.close()  # closes the connection: the server cancels the task

    def pool_processing(self) -> bool:
        return any(s["id"] == POOL and s["is_processing"] for s in self.pool.client.slots())

    def ensure_running(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
            self.started += 1
        deadline = time.monotonic() + 60
        while not self.pool_processing():
            assert time.monotonic() < deadline, "the pool slot never became busy"
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)
        deadline = time.monotonic() + 60
        while self.pool_processing():
            assert time.monotonic() < deadline, "the busy generation was not cancelled"
            time.sleep(0.05)


@pytest.fixture
def busy(pool: Pool) -> Iterator[BusyPool]:
    b = BusyPool(pool)
    try:
        yield b
    finally:
        b.close()
        pool.reset()
    assert not b.errors, b.errors


@common_settings(15)
@given(suffix=SUFFIX, data=st.data())
def test_busy_pool_is_never_shared(pool: Pool, busy: BusyPool, suffix: str, data: st.DataObject) -> None:
    """While the pool slot generates, a sharer whose prompt and P would hit gets pool_busy."""
    pool.reset(prime=False)  # a prime pinned to the pool would wait for the busy task
    busy.ensure_running()
    prompt = BASE + suffix
    toks = pool.client.prompt_tokens(prompt)
    p = data.draw(st.integers(1, max(1, common_prefix_len(pool.tokens, toks))), label="P")
    body = request_body("/completion", prompt, {"shared_pool_slot": POOL, "shared_prefix_n_tokens": p})
    resp = pool.post("/completion", body)
    still_busy = busy.pool_processing()  # busy before the request and after it: busy when it was decided
    # if the story ended meanwhile (not expected) either outcome is allowed, but a hit must still be exact
    reported = (resp.json().get("shared_prefix") or {}).get("status") if resp.status_code == 200 else None
    status = check_answer(pool, "/completion", body, resp, SHARER, busy=still_busy or reported == "pool_busy")
    tally("pool_busy", status if still_busy else f"{status} (pool went idle)")
    pool.alive()


# ----------------------------------------------------------------------------- not JSON


MALFORMED = [
    b'{"prompt": "x", "n_predict": 1, "shared_pool_slot": NaN, "shared_prefix_n_tokens": 1}',
    b'{"prompt": "x", "n_predict": 1, "shared_pool_slot": 0, "shared_prefix_n_tokens": Infinity}',
    b'{"prompt": "x", "n_predict": 1, "shared_pool_slot": 0, "shared_prefix_n_tokens": 1e400}',
    b'{"prompt": "\\ud800", "n_predict": 1, "shared_pool_slot": 0, "shared_prefix_n_tokens": 1}',
    b'{"prompt": "\xff\xfe", "n_predict": 1, "shared_pool_slot": 0, "shared_prefix_n_tokens": 1}',
    b'{"prompt": "x", "shared_pool_slot": 0,',
    b"shared_pool_slot=0",
]


def test_malformed_json_is_upstreams_500_and_harmless(pool: Pool) -> None:
    """Bodies that are not JSON get upstream llama-server's answer to a parser exception: HTTP 500 with
    the parser's message (the reference server answers the same way). Nothing reaches the pool code,
    the server stays up and the pool still shares."""
    pool.reset()
    for raw in MALFORMED:
        resp = pool.http.post("/completion", content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == 500, (raw, resp.status_code, resp.text[:200])
        assert "[json.exception." in error_message(resp.content), resp.text[:200]
        tally("malformed_json", "500 json.exception")
        pool.alive()
    prompt = BASE + "Q: when was the bridge rebuilt? A:"
    p = common_prefix_len(pool.tokens, pool.client.prompt_tokens(prompt))
    body = request_body("/completion", prompt, {"shared_pool_slot": POOL, "shared_prefix_n_tokens": p})
    assert check_answer(pool, "/completion", body, pool.post("/completion", body), SHARER) == "hit"
