"""The oracle's ledger (polykv_py.harness.ledger): what a slot may hold, and which takes are violations."""

from __future__ import annotations

from polykv_py.harness.ledger import ALL, Holder, Ledger, PoolView, mac_of, sha256_of

A, B, NONE = ("salt-a", True), ("salt-b", True), ("", True)
DOC = tuple(range(100, 160))


def ledger() -> Ledger:
    return Ledger(slots=[0, 1, 2, 3], pools=[0])


def test_a_take_of_the_same_tenants_exact_cells_is_fine() -> None:
    led = ledger()
    led.begin_round()
    led.add(1, Holder(A, DOC, origin="r1"))
    assert led.check_take(1, A, [*DOC[:50], 7, 8], 50, what="x", exclude="r2") is None


def test_another_tenants_cells_are_a_salt_finding_unless_a_holder_of_its_own_has_them() -> None:
    led = ledger()
    led.begin_round()
    led.add(1, Holder(A, DOC, child=True, origin="parent-child"))
    f = led.check_take(1, NONE, DOC, 40, what="x", exclude="me")
    assert f is not None and f.kind == "salt" and "parent-child" in f.detail
    led.add(1, Holder(NONE, DOC[:45], origin="earlier"))  # an unsalted holder with those tokens: not provable
    assert led.check_take(1, NONE, DOC, 40, what="x", exclude="me") is None


def test_shifted_cells_beyond_the_exact_part_are_an_inexact_finding() -> None:
    led = ledger()
    led.begin_round()
    led.add(2, Holder(A, DOC, exact=20, origin="reuse"))
    assert led.check_take(2, A, DOC, 20, what="x", exclude="me") is None
    f = led.check_take(2, A, DOC, 30, what="x", exclude="me")
    assert f is not None and f.kind == "inexact"


def test_only_holders_with_the_takers_tokens_are_candidates_and_own_holders_are_excluded() -> None:
    led = ledger()
    led.begin_round()
    led.add(1, Holder(A, (1, 2, 3, 4), origin="other"))
    led.add(1, Holder(NONE, DOC, origin="me"))
    assert led.check_take(1, NONE, DOC, 30, what="x", exclude="me") is None  # nobody else: unexplained
    assert led.unexplained and "no holder" in led.unexplained[0]


def test_children_are_cleared_at_the_end_of_a_round_and_parents_stay() -> None:
    led = ledger()
    led.begin_round()
    led.add(1, Holder(A, DOC, origin="parent"))
    led.add(2, Holder(A, DOC, child=True, origin="child"))
    led.end_round({0: PoolView(False, False, None, None)}, ["salt-a"])
    assert [h.origin for h in led.resident[1]] == ["parent"]
    assert led.resident[2] == []
    led.begin_round()
    assert led.check_take(2, A, DOC, 10, what="x") is None and led.unexplained  # nothing left there


def test_a_pool_is_matched_by_hash_or_mac_and_a_salted_prefix_shown_unsalted_is_a_finding() -> None:
    led = ledger()
    led.begin_round()
    led.add(1, Holder(A, DOC, origin="salted"))
    led.note_promotion(1, A, DOC, 30)
    shown_plain = PoolView(True, False, sha256_of(DOC[:30]), None)
    (f,) = led.end_round({0: shown_plain}, ["salt-a"])
    assert f.kind == "shown_unsalted"
    led.begin_round()
    led.note_promotion(1, A, DOC, 30)
    assert led.end_round({0: PoolView(True, True, None, mac_of(DOC[:30], "salt-a"))}, ["salt-a"]) == []
    assert [h.tokens for h in led.resident[0]] == [DOC[:30]]
    assert led.resident[0][0].exact == ALL


def test_a_share_from_a_pool_sees_this_rounds_promotions() -> None:
    led = ledger()
    led.begin_round()
    led.add(2, Holder(B, DOC, origin="src"))
    led.note_promotion(2, B, DOC, 40)
    assert led.check_take(0, B, DOC, 40, what="x") is None
    f = led.check_take(0, A, DOC, 40, what="x")
    assert f is not None and f.kind == "salt"


def test_a_cancelled_request_may_have_promoted_any_prefix_it_shared() -> None:
    led = ledger()
    led.begin_round()
    long_doc = tuple(range(1000, 1200))
    led.add(3, Holder(A, long_doc, origin="agent"))
    led.note_unseen_share((*long_doc[:70], 1, 2, 3))  # its answer never came: any share it made is unseen
    assert led.end_round({0: PoolView(True, True, None, mac_of(long_doc[:70], "salt-a"))}, ["salt-a"]) == []
    assert not led.unexplained and [h.tokens for h in led.resident[0]] == [long_doc[:70]]
