"""The phase clock of `--phase_timing` (`ldm.train.phases`), on a clock the test moves."""

import pytest

from ldm.train import phases


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(phases.time, "perf_counter", lambda: now[0])
    return now


def test_each_lap_is_the_time_since_the_last_and_a_window_adds_up_to_one(clock, monkeypatch):
    synchronized = []
    monkeypatch.setattr(phases, "synchronize", lambda: synchronized.append(clock[0]))
    timer = phases.PhaseClock(True)
    clock[0] = 5.0
    timer.restart()  # what came before the first update is no phase
    for at, name in ((6.0, "data"), (8.0, "forward"), (9.0, "data"), (11.0, "forward")):
        clock[0] = at
        timer.lap(name)
    clock[0] = 13.0
    window = timer.read()  # the rest since the last lap is "other"
    assert window["phase_data"] == pytest.approx(2 / 8) and window["phase_forward"] == pytest.approx(4 / 8)
    assert window["phase_other"] == pytest.approx(2 / 8) and sum(window.values()) == pytest.approx(1)
    assert synchronized == [6.0, 8.0, 9.0, 11.0, 13.0]  # the device waited for before each lap
    clock[0] = 17.0
    timer.lap("optimizer")
    assert timer.read()["phase_optimizer"] == pytest.approx(1.0)  # the next window starts where the last ended


def test_off_it_neither_waits_for_the_device_nor_logs(clock, monkeypatch):
    def refuse():
        raise AssertionError("synchronised with the timing off")

    monkeypatch.setattr(phases, "synchronize", refuse)
    timer = phases.PhaseClock(False)
    clock[0] = 3.0
    timer.lap("forward")
    assert timer.read() == {}
