"""Provenance follows the cells (patch 0078, issue 34): one test per path that puts cells into a sequence.

A share is exact only if every cell it hands over was computed from its own tokens, unshifted, under the
requester's cache_salt and LoRA set. Upstream moves cells into a slot on many paths; each test here drives one of
them on the real server and checks that what a later request gets is what the provenance allows (each failed on
main a8fb95a, where the origin was a label on the slot set at prompt start only):

- ``n_cmpl`` > 1 children carry the parent's salt: an unsalted request shares nothing from the child of a salted
  request, the same salt does, and a salted prefix promoted from it stays salted (no unsalted save);
- chunk reuse (``n_cache_reuse``) makes the moved cells inexact: a later request that asked for nothing gets only
  the cells before them, and answers as the reference server computing the prompt fresh; a named pool answers
  ``inexact`` and refuses to be saved until it is primed again;
- context shift makes a pool inexact: it is not saved;
- an upstream slot file restored into an ordinary slot has no recorded origin: never shared or reused;
- the host prompt cache carries the provenance: a prompt it restores shares under its own salt (it used to be
  forgotten), never under another;
- the ``--share-any`` slot choice compares the LoRA set a task runs with (adapters loaded with a scale), so an
  agent's next turn goes back to its own slot;
- a coalescing wait is bounded (``--share-any-max-wait``);
- timing: a request's time to first token does not tell whether another salt computed its prefix (AUC of
  hit-vs-miss near 0.5), while within one salt it does (the control, AUC near 1).

The "deleted fact" prompts give a shifted share teeth on this 135M model: a chunk asking for a fact is computed
after a paragraph that states it, then that paragraph is cut out by chunk reuse; cells computed over the fact
answer with it, an exact computation does not know it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polykv_py.client import Client, Share
from polykv_py.errors import HTTPError
from polykv_py.harness.compare import compare_greedy
from polykv_py.harness.lora import write_adapter
from polykv_py.harness.salt_timing import measure_salt_timing
from polykv_py.llama_server import LlamaServer
from polykv_py.presets import (
    NO_CLEAR_IDLE,
    UNIFIED_KV,
    custom_server,
    pool_slot_args,
    reference_server,
    serve_server,
    slot_actions_args,
    slots_args,
)
from polykv_py.tokens import common_prefix_len

pytestmark = pytest.mark.integration

POOL = 0
AGENTS = 4
CTX = 8192
GREEDY: dict[str, Any] = {"temperature": 0, "n_predict": 12, "n_probs": 5, "cache_prompt": True}
SALT_A, SALT_B = "tenant-A-7f3e9c", "tenant-B-1d0a44"

#: Y: the common start; X: a paragraph stating a fact; C: a chunk asking for it (>= 16 tokens, chunk-reusable).
FILLER = "Numbers: " + ", ".join(str(i * 7) for i in range(25)) + ".\n\n"
FACT = "The capital of Zorbania is Quexville. " * 8 + "\n\n"
ASK = "Q: What is the capital of Zorbania?\nA: The capital of Zorbania is"
BASE = "\n".join(f"Record {i}: vault {i % 9} holds {i * 7 % 53} sealed boxes from shipment {i}." for i in range(40))


@pytest.fixture(scope="module")
def srv(logs: Path, save_dir: Path) -> Iterator[LlamaServer]:
    """``polykv serve``'s recipe: one reserved pool, 4 agent slots, --share-any, slot files in save_dir."""
    s = serve_server(1, agent_slots=AGENTS, ctx=CTX, threads=2, slot_save_path=f"{save_dir}/", log_dir=logs,
                     name="provenance", shared_decode=False)  # fmt: skip
    with s.start():
        yield s


@pytest.fixture(scope="module")
def ref(logs: Path) -> Iterator[LlamaServer]:
    s = reference_server(n_slots=2, ctx=CTX, threads=2, log_dir=logs)
    with s.start():
        yield s


@pytest.fixture
def c(srv: LlamaServer) -> Iterator[Client]:
    with Client(srv.url, timeout=600) as client:
        for slot in range(AGENTS + 1):
            client.erase_slot(slot)
        yield client


def fresh(ref: LlamaServer, prompt: str) -> dict[str, Any]:
    """The reference server's answer computed from scratch (its slot erased first)."""
    with Client(ref.url, timeout=600) as r:
        r.erase_slot(0)
        return r.completion(prompt, id_slot=0, **GREEDY)


def n_tokens(c: Client, text: str) -> int:
    return len(c.prompt_tokens(text))


def n_common(c: Client, a: str, b: str) -> int:
    """Tokens two prompts have in common (their tokenizations: a text's last token may merge with the next)."""
    return common_prefix_len(c.prompt_tokens(a), c.prompt_tokens(b))


def cached(res: dict[str, Any]) -> int:
    return int(res["timings"]["cache_n"])


def shifted_slot(c: Client, slot: int) -> int:
    """Leave ``slot`` holding FILLER + ASK whose ASK cells were computed after FACT and shifted into place by chunk
    reuse; returns the number of exact cells (the two prompts' common prefix)."""
    c.completion(FILLER + FACT + ASK, id_slot=slot, **GREEDY)
    moved = c.completion(FILLER + ASK, id_slot=slot, n_cache_reuse=8, **GREEDY)
    n_exact = n_common(c, FILLER + FACT + ASK, FILLER + ASK)
    assert moved["timings"]["prompt_n"] < n_tokens(c, FILLER + ASK) - n_exact, "the set-up did not shift the chunk"
    return n_exact


# ------------------------------------------------------------------------------ n_cmpl children
def salted_pair_generating(c: Client, srv: LlamaServer) -> tuple[threading.Thread, dict[str, Any]]:
    """A salted n_cmpl=2 request over BASE, still generating when this returns."""
    out: dict[str, Any] = {}

    def run() -> None:
        with Client(srv.url, timeout=600) as own:
            out["res"] = own.completion(BASE + "\nQ: vault 1?", n_cmpl=2, n_predict=300, ignore_eos=True,
                                        temperature=0, cache_salt=SALT_A)  # fmt: skip

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        busy = [s for s in c.slots() if s["is_processing"] and s.get("next_token", [{}])[0].get("n_decoded", 0) > 0]
        if len(busy) == 2:
            return t, out
        time.sleep(0.1)
    raise AssertionError("the salted n_cmpl=2 request did not start generating")


def test_children_of_a_salted_request_share_only_with_its_salt(c: Client, srv: LlamaServer) -> None:
    """While a salted n_cmpl=2 request generates, its child slot holds the salted prefix (upstream clears a child
    at release): another salt or none gets nothing from it, the same salt shares, and the prefix that share
    promotes into the reserved pool stays salted."""
    t, out = salted_pair_generating(c, srv)
    try:
        plain = c.completion(BASE + "\nQ: vault 2?", **GREEDY)
        other = c.completion(BASE + "\nQ: vault 3?", cache_salt=SALT_B, **GREEDY)
        same = c.completion(BASE + "\nQ: vault 4?", cache_salt=SALT_A, **GREEDY)
    finally:
        t.join()
    for res in (plain, other):
        assert "shared_prefix" not in res, res.get("shared_prefix")
        assert cached(res) < 16, "another salt's cells were reused"
    assert same["shared_prefix"]["status"] == "hit"
    assert same["shared_prefix"]["pool_slot"] in {r["id_slot"] for r in out["res"]}
    (pool,) = [s for s in c.slots() if s["id"] == POOL]
    state = pool["polykv_pool_state"]
    assert state["promoted"] is True and state["salted"] is True and state["tokens_sha256"] is None, state
    with pytest.raises(HTTPError, match="does not match this request"):
        c.save_pool(POOL, "promoted-unsalted.pkvpool")
    c.save_pool(POOL, "promoted-salted.pkvpool", cache_salt=SALT_A)


# ------------------------------------------------------------------------------ chunk reuse
def test_shifted_cells_are_never_shared_as_exact(c: Client, ref: LlamaServer) -> None:
    n_exact = shifted_slot(c, 2)
    res = c.completion(FILLER + ASK, **GREEDY)  # asks for nothing approximate
    assert cached(res) <= n_exact, f"{cached(res)} cells taken (shared or own cache), only {n_exact} are exact"
    cmp = compare_greedy(res, fresh(ref, FILLER + ASK))
    assert cmp.ok, cmp.detail


def test_a_named_pool_with_shifted_cells_is_inexact_and_not_saved(c: Client) -> None:
    n_exact = shifted_slot(c, POOL)
    p = n_tokens(c, FILLER + ASK) - 1
    named = c.completion(FILLER + ASK + " Q", share=Share(POOL, p), id_slot=1, **GREEDY)
    assert named["shared_prefix"]["status"] == "inexact" and named["shared_prefix"]["exact"] == n_exact
    auto = c.completion(FILLER + ASK + " Q", share=Share(POOL), id_slot=2, **GREEDY)
    assert auto["shared_prefix"]["shared"] <= n_exact, auto["shared_prefix"]
    (pool,) = [s for s in c.slots() if s["id"] == POOL]
    assert pool["polykv_pool_state"]["exact"] is False
    with pytest.raises(HTTPError, match="moved by a shift"):
        c.save_pool(POOL, "shifted.pkvpool")
    c.completion(FILLER + ASK, id_slot=POOL, **GREEDY)  # primed again: recomputed, not reused
    c.save_pool(POOL, "reprimed.pkvpool")


# ------------------------------------------------------------------------------ slot files
def test_a_restored_slot_file_is_never_shared_nor_reused(c: Client) -> None:
    c.completion(BASE + "\nQ: vault 5?", id_slot=2, cache_salt=SALT_A, **GREEDY)
    c.request("POST", "/slots/2?action=save", {"filename": "salted-slot.bin"})
    c.erase_slot(2)
    c.completion("Hello there, how are you today?", id_slot=3, **GREEDY)  # slot 3's last task: unsalted
    c.request("POST", "/slots/3?action=restore", {"filename": "salted-slot.bin"})
    res = c.completion(BASE + "\nQ: vault 6?", **GREEDY)
    assert "shared_prefix" not in res and cached(res) < 16, (res.get("shared_prefix"), cached(res))


# ------------------------------------------------------------------------------ context shift
def test_a_context_shifted_pool_is_not_saved(logs: Path, save_dir: Path) -> None:
    args = [UNIFIED_KV, *slots_args(2, 512), NO_CLEAR_IDLE, "--slots", "--context-shift", "--cache-ram", "0",
            *slot_actions_args(f"{save_dir}/"), *pool_slot_args([POOL])]  # fmt: skip
    s = custom_server("patched", args, threads=2, log_dir=logs, name="provenance-ctx-shift")
    with s.start(), Client(s.url, timeout=600) as c:
        res = c.completion(BASE[:600], id_slot=POOL, n_predict=500, ignore_eos=True, temperature=0)
        assert res["tokens_evaluated"] + res["tokens_predicted"] > 512, "no context shift happened"
        with pytest.raises(HTTPError, match="moved by a shift"):
            c.save_pool(POOL, "ctx-shifted.pkvpool")
        assert not (save_dir / "ctx-shifted.pkvpool").exists()


# ------------------------------------------------------------------------------ host prompt cache
def test_the_host_cache_carries_the_salt(logs: Path) -> None:
    """Cells a slot takes back from the host cache keep the salt that computed them: the same salt shares them
    (main forgot it, so nothing was shared), another salt never does."""
    args = [UNIFIED_KV, *slots_args(2, 4096), NO_CLEAR_IDLE, "--cache-ram", "256", "--slots", *slot_actions_args()]
    other = " ".join(f"unrelated{i}" for i in range(200))
    question = "\nQuestion: what does vault 2 hold?\nAnswer:"
    s = custom_server("patched", args, threads=2, log_dir=logs, name="provenance-host-cache")
    with s.start(), Client(s.url, timeout=600) as c:
        c.completion(BASE + "\nQ: vault 1?", id_slot=0, cache_salt=SALT_A, **GREEDY)
        c.completion(other, id_slot=0, cache_salt=SALT_A, **GREEDY)  # slot 0's cells go to the host cache
        back = c.completion(BASE + question, id_slot=0, cache_salt=SALT_A, **GREEDY)
        assert cached(back) > n_tokens(c, BASE) // 2, "the prompt did not come back from the host cache"
        same = c.completion(BASE + "\nQ: vault 3?", share=Share(0), id_slot=1, cache_salt=SALT_A, **GREEDY)
        assert same["shared_prefix"]["status"] == "hit", same["shared_prefix"]
        c.erase_slot(1)
        other_salt = c.completion(BASE + "\nQ: vault 3?", share=Share(0), id_slot=1, cache_salt=SALT_B, **GREEDY)
        assert other_salt["shared_prefix"]["status"] == "salt_mismatch", other_salt["shared_prefix"]


# ------------------------------------------------------------------------------ LoRA and the slot choice
def test_an_agents_next_turn_goes_back_to_its_slot_with_an_adapter_loaded(
    logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With an adapter loaded at scale 1 (the server's default set), the slot choice used to compare each slot
    with a list whose scales were all 0: every slot looked like another LoRA set, and a turn went to the least
    recently used slot, destroying another agent's history."""
    adapter = write_adapter(tmp_path_factory.mktemp("lora") / "kv-lora.gguf")
    with (
        serve_server(
            1,
            agent_slots=3,
            ctx=4096,
            threads=2,
            log_dir=logs,
            name="provenance-lora",
            extra_args=["--lora", str(adapter)],
        ).start() as s,  # fmt: skip
        Client(s.url, timeout=600) as c,
    ):
        turns = {}
        for agent in ("alpha", "beta", "gamma"):
            prompt = f"Agent {agent} keeps this log.\n" + BASE[: 400 + len(agent)] + f"\nTurn 1 of {agent}:"
            turns[agent] = (prompt, c.completion(prompt, **GREEDY))
        prompt, first = turns["gamma"]  # the most recently used slot: upstream's LRU would pick alpha's
        second = c.completion(prompt + first["content"] + "\nTurn 2:", **GREEDY)
        assert second["id_slot"] == first["id_slot"], (first["id_slot"], second["id_slot"])
        assert cached(second) >= n_tokens(c, prompt) - 1


# ------------------------------------------------------------------------------ coalescing
def test_a_coalescing_wait_is_bounded(logs: Path) -> None:
    """A prompt waits for another slot's prefill of their common prefix at most --share-any-max-wait ms, then
    computes the rest itself; with the default bound it waits and computes only its own suffix. (The waiter runs on
    the lower slot, so each scheduler pass visits it before the leader fills the 128-token batch.)"""
    long_base = BASE * 2  # ~1,600 tokens: several seconds of prefill on 2 threads
    waited: dict[int, dict[str, Any]] = {}
    suffix = 0
    for max_wait in (200, 60000):
        s = serve_server(1, agent_slots=2, ctx=8192, threads=2, log_dir=logs, name=f"provenance-wait-{max_wait}",
                         extra_args=["--share-any-max-wait", str(max_wait), "-b", "128", "-ub", "128"])  # fmt: skip
        with s.start(), Client(s.url, timeout=600) as c:
            leader = threading.Thread(target=lambda c=c: c.completion(long_base + "\nQ: 1?", id_slot=2, **GREEDY))
            leader.start()
            time.sleep(1.0)
            waited[max_wait] = c.completion(long_base + "\nQ: 2?", id_slot=1, **GREEDY)
            leader.join()
            suffix = n_tokens(c, long_base + "\nQ: 2?") - n_common(c, long_base + "\nQ: 1?", long_base + "\nQ: 2?")
    short, long = waited[200], waited[60000]
    assert short["shared_prefix"]["waited"] is True and long["shared_prefix"]["waited"] is True
    assert long["timings"]["prompt_n"] <= suffix + 1, long["timings"]
    assert short["timings"]["prompt_n"] > 10 * suffix, "the bounded wait did not stop waiting"


# ------------------------------------------------------------------------------ timing across salts
def test_ttft_does_not_tell_another_salts_prefix(logs: Path) -> None:
    """Paired trials (polykv_py.harness.salt_timing): tenant A computes the prefix (hit) or another text of the
    same length (miss), then tenant B times its first token over the prefix. Across salts the two are
    indistinguishable; within one salt (B computed the prefix itself) a hit is always faster: the control."""
    s = serve_server(1, agent_slots=3, ctx=8192, threads=2, log_dir=logs, name="provenance-timing")
    with s.start():
        timing = measure_salt_timing(s.url, trials=12, salt_a=SALT_A, salt_b=SALT_B)
    (logs / "ttft-auc.json").write_text(json.dumps(timing.to_json()))
    assert timing.auc_within_salt >= 0.95, f"the control has no teeth: {timing.to_json()}"
    assert timing.auc_across_salts < 0.9, f"TTFT tells whether another salt computed the prefix: {timing.to_json()}"
