"""cached/store/lru.py: the store's recency and size bookkeeping, apart from any I/O."""

from __future__ import annotations

import math
import random

import pytest

from cached.store.lru import LRU, Selection


def lru_of(*items: tuple[str, int, float], files: int = 1) -> LRU:
    lru = LRU()
    for key, size, used in items:
        lru.put(key, size, files, used)
    return lru


def test_keys_come_oldest_first_and_totals_add_up():
    lru = lru_of(("c", 30, 3.0), ("a", 10, 1.0), ("b", 20, 2.0))
    assert list(lru.oldest()) == ["a", "b", "c"]
    assert (len(lru), lru.bytes, lru.files) == (3, 60, 3)
    assert "a" in lru and "z" not in lru
    assert lru.get("b") == (20, 1, 2.0) and lru.get("z") is None


def test_ties_go_in_the_order_keys_were_first_put_and_a_put_again_keeps_its_place():
    lru = lru_of(("x", 1, 5.0), ("y", 1, 5.0), ("z", 1, 5.0))
    assert list(lru.oldest()) == ["x", "y", "z"]
    lru.put("x", 7, 2, 5.0)  # same time: keeps its place, new size
    assert list(lru.oldest()) == ["x", "y", "z"] and lru.bytes == 9 and lru.files == 4
    lru.put("y", 1, 1, 4.0)  # earlier time: moves first
    assert list(lru.oldest()) == ["y", "x", "z"]
    lru.remove("x")
    lru.put("x", 1, 1, 5.0)  # removed then put: now the last put of its time
    assert list(lru.oldest()) == ["y", "z", "x"]


def test_touch_moves_a_key_and_removal_forgets_it():
    lru = lru_of(("a", 10, 1.0), ("b", 20, 2.0), ("c", 30, 3.0))
    lru.touch("a", 4.0)
    assert list(lru.oldest()) == ["b", "c", "a"] and lru.get("a") == (10, 1, 4.0)
    lru.touch("a", 0.5)  # a clock stepped back: ordered by the time, not the call
    assert list(lru.oldest()) == ["a", "b", "c"]
    assert lru.remove("b") and not lru.remove("b")
    assert list(lru.oldest()) == ["a", "c"] and (len(lru), lru.bytes, lru.files) == (2, 40, 2)
    assert lru.remove("a") and lru.remove("c")
    assert list(lru.oldest()) == [] and (lru.bytes, lru.files) == (0, 0)


def test_many_touches_keep_the_heap_bounded_and_the_order_right():
    lru = lru_of(*((f"k{i}", 1, float(i)) for i in range(10)))
    for t in range(1000):
        lru.touch(f"k{t % 10}", 100.0 + t)
    assert len(lru._heap) <= 2 * len(lru) + 65
    assert list(lru.oldest()) == [f"k{i}" for i in range(10)]


def test_the_order_matches_a_stable_sort_under_random_changes():
    rng = random.Random(25)
    lru, model, order = LRU(), {}, []  # model: key -> (size, last_used); order: first put
    for _ in range(3000):
        op = rng.random()
        key = f"k{rng.randrange(60)}"
        used = float(rng.randrange(40))  # few distinct times: many ties
        if op < 0.5:
            size = rng.randrange(100)
            lru.put(key, size, 2, used)
            if key not in model:
                order.append(key)
            model[key] = (size, used)
        elif op < 0.8 and key in model:
            lru.touch(key, used)
            model[key] = (model[key][0], used)
        elif key in model:
            assert lru.remove(key)
            del model[key]
            order.remove(key)
        expect = sorted(order, key=lambda k: model[k][1])
        assert list(lru.oldest()) == expect
        assert lru.bytes == sum(s for s, _ in model.values()) and lru.files == 2 * len(model)


def test_select_takes_the_oldest_until_the_budget_fits():
    lru = lru_of(("a", 10, 1.0), ("b", 20, 2.0), ("c", 30, 3.0), ("d", 40, 4.0))
    assert lru.select(max_bytes=100) == Selection((), 0, 100, 4, False)
    assert lru.select(max_bytes=70) == Selection(("a", "b"), 0, 70, 2, False)
    assert lru.select(max_bytes=69).victims == ("a", "b", "c")
    assert lru.select(max_bytes=95, extra_bytes=25).victims == ("a", "b")  # room for 25 more
    assert lru.select(max_bytes=90, extra_bytes=25).victims == ("a", "b", "c")
    assert lru.select(max_files=2).victims == ("a", "b")
    assert lru.select(max_files=3, extra_files=1).victims == ("a", "b")
    assert lru.select(max_bytes=1000, max_files=3).victims == ("a",)
    assert lru.select().victims == ()  # no limits
    assert len(lru) == 4 and lru.bytes == 100  # select changes nothing


def test_select_never_takes_protected_keys_and_spares_the_excluded_ones_size():
    lru = lru_of(("a", 10, 1.0), ("b", 20, 2.0), ("c", 30, 3.0))
    assert lru.select(max_bytes=30, protected={"a"}) == Selection(("b", "c"), 1, 10, 1, False)
    # The excluded key (the incoming one) is not counted, and never evicted when protected.
    assert lru.select(max_bytes=30, exclude="c", protected={"c"}).victims == ()
    assert lru.select(max_bytes=20, exclude="c", protected={"c"}) == Selection(
        ("a",), 0, 20, 1, False)
    assert lru.select(max_bytes=1, exclude="c", protected={"c"}) == Selection(
        ("a", "b"), 0, 0, 0, False)
    everything = lru.select(max_bytes=1, protected={"a", "b", "c"})
    assert everything == Selection((), 3, 60, 3, True)


def test_recent_keys_go_last_and_only_under_a_hard_limit():
    lru = lru_of(("r1", 10, 95.0), ("old", 10, 50.0), ("r2", 10, 99.0))
    hard = lru.select(max_bytes=10, now=100.0, grace=10.0, hard=True)
    assert hard == Selection(("old", "r1"), 0, 10, 1, False)
    soft = lru.select(max_bytes=10, now=100.0, grace=10.0, hard=False)
    assert soft == Selection(("old",), 2, 20, 2, True)  # r1 and r2 would be needed: blocked
    assert lru.select(max_bytes=20, now=100.0, grace=10.0, hard=False) == Selection(
        ("old",), 0, 20, 2, False)
    # The grace boundary: used exactly grace seconds ago is not recent.
    assert lru.select(max_bytes=10, now=105.0, grace=10.0, hard=False) == Selection(
        ("old", "r1"), 0, 10, 1, False)
    # A last use after now (a clock stepped back) is recent, even with no grace at all.
    assert lru.select(max_bytes=10, now=60.0, grace=0.0, hard=False) == Selection(
        ("old",), 2, 20, 2, True)


def test_iterating_while_the_lru_changes_is_an_error():
    lru = lru_of(("a", 1, 1.0), ("b", 1, 2.0))
    it = lru.oldest()
    assert next(it) == "a"
    lru.touch("a", 3.0)
    with pytest.raises(RuntimeError, match="changed"):
        next(it)


@pytest.mark.parametrize("key, size, files, used, error, words", [
    ("", 1, 1, 1.0, TypeError, "non-empty string"),
    (None, 1, 1, 1.0, TypeError, "non-empty string"),
    ("k", -1, 1, 1.0, ValueError, "size of k is negative"),
    ("k", 1.5, 1, 1.0, TypeError, "size of k is an integer"),
    ("k", True, 1, 1.0, TypeError, "size of k is an integer"),
    ("k", 1, -2, 1.0, ValueError, "files of k is negative"),
    ("k", 1, 1, math.nan, ValueError, "not finite"),
    ("k", 1, 1, math.inf, ValueError, "not finite"),
    ("k", 1, 1, "now", TypeError, "is a number"),
])
def test_bad_input_is_refused_with_what_is_wrong(key, size, files, used, error, words):
    lru = LRU()
    with pytest.raises(error, match=words):
        lru.put(key, size, files, used)
    assert len(lru) == 0 and lru.bytes == 0 and lru.files == 0


def test_touching_an_unknown_key_or_selecting_with_a_bad_limit_is_refused():
    lru = lru_of(("a", 1, 1.0))
    with pytest.raises(KeyError, match="not tracked"):
        lru.touch("b", 2.0)
    with pytest.raises(ValueError, match="not finite"):
        lru.touch("a", math.nan)
    assert lru.get("a") == (1, 1, 1.0)
    for bad in ({"max_bytes": -1}, {"max_files": 1.5}, {"extra_bytes": None}):
        with pytest.raises(ValueError, match="non-negative integer"):
            lru.select(**bad)


def sorted_selection(rows, *, max_bytes, max_files, extra_bytes, extra_files, exclude,
                     protected, now, grace, hard):
    """The selection Store.evict made before the LRU type: every row sorted by last use
    (a stable sort, so ties in insertion order) on each call."""
    size = sum(r["size"] for r in rows if r["key"] != exclude)
    files = sum(r["files"] for r in rows if r["key"] != exclude)

    def over():
        return bool((max_bytes and size + extra_bytes > max_bytes)
                    or (max_files and files + extra_files > max_files))

    victims, recent, blocked = [], [], 0
    for row in sorted(rows, key=lambda r: r["last_used"]):
        if not over():
            break
        if row["key"] in protected:
            blocked += 1
        elif now - row["last_used"] < grace:
            recent.append(row)
        else:
            victims.append(row["key"])
            size -= row["size"]
            files -= row["files"]
    for row in recent:
        if not over():
            break
        if hard:
            victims.append(row["key"])
            size -= row["size"]
            files -= row["files"]
        else:
            blocked += 1
    return Selection(tuple(victims), blocked, size, files, over())


def test_select_matches_sorting_every_row_as_the_store_did():
    rng = random.Random(6)
    for _ in range(400):
        lru, rows = LRU(), {}
        for i in range(rng.randrange(1, 30)):
            row = {"key": f"k{i}", "size": rng.randrange(50), "files": rng.choice([1, 2, 3]),
                   "last_used": float(rng.randrange(20))}
            lru.put(row["key"], row["size"], row["files"], row["last_used"])
            rows[row["key"]] = row
        for key in rng.sample(sorted(rows), k=len(rows) // 3):  # hits: new last uses
            rows[key]["last_used"] = float(rng.randrange(25))
            lru.touch(key, rows[key]["last_used"])
        keys = sorted(rows)
        exclude = rng.choice([None, *keys])
        args = dict(max_bytes=rng.choice([0, rng.randrange(1, 600)]),
                    max_files=rng.choice([0, rng.randrange(1, 60)]),
                    extra_bytes=rng.randrange(30), extra_files=rng.randrange(3),
                    exclude=exclude,
                    protected=set(rng.sample(keys, k=min(len(keys), rng.randrange(3)))) | {exclude},
                    now=20.0, grace=float(rng.randrange(0, 15)), hard=rng.random() < 0.5)
        if not args["max_bytes"] and not args["max_files"]:
            continue
        assert lru.select(**args) == sorted_selection(list(rows.values()), **args), args
