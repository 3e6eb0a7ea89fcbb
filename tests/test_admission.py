"""The admission rule (free_transformer.inference.admission), which `run_rows` (generate) and the server's scheduler
both follow: the fewest rows in flight first, then the request due first, then the oldest; a request's share of
the slots; a dropped request; one request's rows in their order."""

import pytest

from free_transformer.inference.admission import Admission, Request


def names(taken) -> list[str]:
    return [row for _, row in taken]


def test_one_request_joins_its_rows_in_their_order():
    queue: Admission[str] = Admission()
    request = queue.add(Request(f"r{i}" for i in range(7)))
    assert names(queue.take(3)) == ["r0", "r1", "r2"]
    assert names(queue.take(0)) == []
    assert names(queue.take(2)) == ["r3", "r4"]
    assert request.in_flight == 5 and queue.waiting == [request]
    assert names(queue.take(5)) == ["r5", "r6"]
    assert queue.waiting == [] and request.admitted == request.in_flight == 7
    assert names(queue.take(5)) == []


def test_a_lazy_requests_rows_are_read_one_ahead_of_those_taken():
    read = []

    def rows():
        for i in range(5):
            read.append(i)
            yield i

    queue: Admission[int] = Admission()
    queue.add(Request(rows()))
    assert read == [0]  # to know that it has a row
    queue.take(2)
    assert read == [0, 1, 2]
    queue.take(5)
    assert read == [0, 1, 2, 3, 4]


def test_the_next_slot_goes_to_the_request_with_the_fewest_rows_in_flight():
    queue: Admission[str] = Admission()
    a = queue.add(Request(["a0", "a1", "a2"], tokens=10))
    b = queue.add(Request(["b0", "b1"], tokens=20))
    assert names(queue.take(4)) == ["a0", "b0", "a1", "b1"]  # a is due first: it wins each tie
    assert (a.in_flight, b.in_flight) == (2, 2) and queue.waiting == [a]
    c = queue.add(Request(["c0", "c1"], tokens=1000), now=5)
    assert names(queue.take(2)) == ["c0", "c1"]  # none in flight beats a's 2, then c's 1 beats a's 2
    assert c.in_flight == 2 and queue.waiting == [a]
    a.left()
    a.left()
    assert names(queue.take(1)) == ["a2"]  # a's rows ended: it has the fewest in flight again


def test_among_equals_in_flight_the_request_due_first_then_the_oldest():
    queue: Admission[str] = Admission()
    queue.add(Request(["long"], tokens=60), now=0)  # due at 60
    queue.add(Request(["tie"], tokens=50), now=10)  # due at 60 too, but arrived later
    queue.add(Request(["short"], tokens=4), now=10)  # due at 14
    assert names(queue.take(3)) == ["short", "long", "tie"]


def test_a_long_request_is_passed_only_until_its_due_step():
    queue: Admission[str] = Admission()
    queue.add(Request(["long"], tokens=60), now=0)  # due at 60
    queue.add(Request(["before"], tokens=4), now=55)  # due at 59: passes it
    queue.add(Request(["after"], tokens=4), now=57)  # due at 61: waits for it
    assert names(queue.take(3)) == ["before", "long", "after"]


def test_a_request_takes_at_most_its_share_of_the_slots():
    queue: Admission[int] = Admission(share=2)
    alone = queue.add(Request(range(5)))
    assert names(queue.take(4)) == [0, 1]  # two slots stay free for a newcomer
    newcomer = queue.add(Request(["n0", "n1", "n2"]))
    assert names(queue.take(4)) == ["n0", "n1"]
    alone.left()
    newcomer.left()
    assert names(queue.take(4)) == [2, "n2"]
    assert queue.waiting == [alone]


def test_a_share_below_one_row_is_refused():
    with pytest.raises(ValueError, match="at least 1 row, got 0"):
        Admission(share=0)


def test_a_dropped_request_is_admitted_no_more():
    queue: Admission[str] = Admission()
    cancelled = queue.add(Request(["c0", "c1", "c2"], tokens=1))
    kept = queue.add(Request(["k0", "k1"], tokens=100))
    assert names(queue.take(1)) == ["c0"]
    queue.drop(cancelled)
    queue.drop(cancelled)  # dropped twice: nothing more happens
    assert queue.waiting == [kept]
    assert names(queue.take(5)) == ["k0", "k1"]
    assert cancelled.admitted == 1


def test_a_request_without_rows_is_not_queued():
    queue: Admission[str] = Admission()
    queue.add(Request([]))
    assert queue.waiting == [] and names(queue.take(3)) == []


def test_each_row_comes_with_its_request_and_tag():
    queue: Admission[str] = Admission()
    first = queue.add(Request(["x"], tag="first"))
    second = queue.add(Request(["y"], tag="second"))
    assert [(request.tag, row) for request, row in queue.take(2)] == [("first", "x"), ("second", "y")]
    assert (first.order, second.order) == (0, 1)


def test_a_short_request_is_admitted_within_its_bound_under_any_flood():
    """The audit's flood: 1,000 one-row requests of 100 tokens at step 0, a 4-token one at step 200 (due 204, after
    every one of them: it waited for all 1,000). It is admitted within 3k + 3 slots, k = 0 requests shorter."""
    queue: Admission[str] = Admission(share=15)
    flood = [queue.add(Request([f"flood{i}"], tokens=100), now=0) for i in range(1000)]
    assert len(queue.take(16)) == 16  # the engine full
    queue.add(Request(["short"], tokens=4), now=200)
    given = []
    for request in flood[:3]:  # rows end, slots free one by one
        request.left()
        given += names(queue.take(1))
    assert "short" in given, given
    admitted_flood = [name for name in given if name != "short"]
    assert admitted_flood and all(name.startswith("flood") for name in admitted_flood)  # the flood keeps 2 in 3


def test_two_slots_in_three_still_go_to_the_requests_due_first():
    queue: Admission[str] = Admission()
    for i in range(4):
        queue.add(Request([f"old{i}"], tokens=100), now=0)  # due at 100
    for i in range(4):
        queue.add(Request([f"new{i}"], tokens=1), now=200)  # due at 201, shorter
    assert names(queue.take(6)) == ["old0", "old1", "new0", "old2", "old3", "new1"]
