"""Goodput and badput (raytrain.control.goodput): each second of a run in one account, by cause, and
the accounts summing to the wall time; with fake workers here, on real actors in test_elastic.py."""

import pytest

from raytrain.control.goodput import CAUSES, Goodput, TimeBook
from tests.test_coordinator import run


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_reload_moves_the_steps_it_undoes_to_work_redone():
    clock = Clock()
    book = TimeBook(clock)
    for step in range(4):
        book.committed(step, 1.0, data_s=0.25)
        book.handled("running", 1.0)
    book.rewind(2)  # steps 2 and 3 run again
    clock.now += 4.0
    record = book.record()
    assert record["good_s"] == pytest.approx(1.5) and record["badput_s"]["work_redone"] == pytest.approx(1.5)
    assert record["badput_s"]["data"] == pytest.approx(1.0) and record["span_s"] == pytest.approx(4.0)


def test_a_lost_step_is_redone_work_up_to_a_typical_step_then_detection():
    book = TimeBook(Clock())
    book.committed(0, 2.0)
    book.handled("running", 2.0)
    book.lost_step(5.0)  # two seconds of work, three noticing the loss
    book.handled("running", 5.0)
    book.handled("repairing", 1.5)
    assert book.badput_s["work_redone"] == 2.0 and book.badput_s["detection"] == 3.0
    assert book.badput_s["re_forming"] == 1.5 and book.badput_s["other"] == 0.0
    book.rolled_forward(1)  # every worker had voted for it after all: its work counts
    assert book.good_s == 4.0 and book.badput_s["work_redone"] == 0.0


def test_the_time_before_the_coordinator_is_start_up_or_a_restart():
    book = {"span_s": 8.0, "good_s": 6.0, "badput_s": dict.fromkeys(CAUSES, 0.0) | {"checkpoint": 2.0}}
    goodput = Goodput.of(book, wall_s=10.0)
    assert goodput.ratio == 0.6 and goodput.badput_s["start_up"] == 2.0
    assert goodput.good_s + sum(goodput.badput_s.values()) == 10.0
    restarted = Goodput.of(book, wall_s=10.0, restart_s=1.5)
    assert restarted.badput_s["coordinator_restart"] == 1.5 and restarted.badput_s["start_up"] == 0.5
    assert goodput.record()["badput_s"] == {"start_up": 2.0, "checkpoint": 2.0}
    assert goodput.text() == "goodput 60.0% of 10.0 s (badput: start up 2.0 s, checkpoint 2.0 s)"


def test_a_coordinators_accounts_cover_its_run(tmp_path):
    # a stage with no live copy: reloaded from the checkpoint of step 2, so step 3 runs again
    _, _, summary, rows = run(tmp_path, "checkpoint.every=2", "elastic.faults=['0:1@3:forward']", dp=1, pp=2)
    assert [e["steps_lost"] for e in rows if e.get("event") == "reload"] == [1]
    book = summary.time_book
    accounted = book["good_s"] + sum(book["badput_s"].values())
    assert accounted == pytest.approx(book["span_s"], rel=0.02, abs=0.002)
    steps = [r["step_s"] for r in rows if "step_s" in r]
    assert len(steps) == 7 and book["good_s"] == pytest.approx(sum(steps) - steps[2])  # step 3's first run undone
    badput = book["badput_s"]
    assert badput["work_redone"] >= steps[2] and badput["re_forming"] > 0 and badput["state_transfer"] > 0
    assert badput["checkpoint"] > 0 and badput["start_up"] > 0


def test_the_time_a_step_spent_compiling_is_start_up_not_goodput():
    book = TimeBook(Clock())
    book.committed(0, 5.0, data_s=0.5, compile_s=4.0)  # train.compile: the first step compiles the layers
    book.committed(1, 0.5, compile_s=0.0)
    assert book.badput_s["start_up"] == 4.0 and book.badput_s["data"] == 0.5 and book.good_s == 1.0
