"""The pure parts of the trainer's accelerator methods, without torch (the unit tier): the
swap plan's learning (trainer/accel/qplan.py: the Q update, epsilon-greedy choice,
convergence on a toy reward, a memory budget never exceeded by the chosen plan, segments of
equal bytes, the largest batch that fits) and the co-training probe (trainer/accel/probe.py:
what a CPU replica adds, and whether it helps). The torch-facing halves are test_swap.py's
and test_hybrid.py's."""
import sys

import numpy as np
import pytest

from trainer.accel.probe import OnOffProbe, cpu_gain
from trainer.accel.qplan import PlanLearner, largest_batch, segments

from conftest import Clock

TYPES = ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Linear"]


def test_the_pure_parts_import_without_torch():
    import subprocess
    code = ("import sys; import trainer.accel.qplan, trainer.accel.probe, trainer.accel; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_q_update_on_hand_computed_values():
    s = PlanLearner(TYPES)
    s.q[3, 1], s.q[5, 2] = 1.0, 2.0
    # 1 + 0.5 * (0.5 + 0.9 * 2 - 1) = 1.65
    assert s.update(3, 1, 0.5, 5, 2) == pytest.approx(1.65)
    assert s.q[3, 1] == pytest.approx(1.65)


def test_epsilon_greedy_choice():
    s = PlanLearner(TYPES, seed=1)
    s.q[0] = np.arange(s.n_actions)[::-1]  # action 0 is best
    s.epsilon = 0.0
    assert all(s.choose(0) == 0 for _ in range(20))
    s.epsilon = 1.0
    picks = np.bincount([s.choose(0) for _ in range(3000)], minlength=s.n_actions)
    assert picks.min() > 3000 / s.n_actions * 0.7  # every action, roughly uniformly


def test_converges_to_the_best_plan_on_a_toy_reward():
    s = PlanLearner(TYPES, w=0.5, seed=0, epsilon_decay=0.97, patience=5)
    # per type: (share of memory saved, share of time added) when swapped
    effect = {"Conv2d": (0.30, 0.02), "BatchNorm2d": (0.10, 0.01), "ReLU": (0.25, 0.01),
              "MaxPool2d": (0.05, 0.20), "Linear": (0.02, 0.40)}

    def measure(plan):
        on = [TYPES[i] for i in range(len(TYPES)) if plan >> i & 1]
        return 1.0 + sum(effect[n][1] for n in on), 1.0 - sum(effect[n][0] for n in on)

    for _ in range(600):
        s.observe(*measure(s.plan))
        if s.converged:
            break
    best = max(range(2 ** len(TYPES)), key=lambda p: s.reward(*measure(p)))
    assert s.converged and s.plan == best
    assert s.plan_dict() == {"Conv2d": True, "BatchNorm2d": True, "ReLU": True,
                             "MaxPool2d": False, "Linear": False}


def test_budget_chooses_the_fastest_plan_within_it_and_never_one_over_it():
    s = PlanLearner(range(4), budget=0.6, seed=0, epsilon_decay=0.95, patience=6)
    # per segment: (share of memory saved, share of time added) when swapped
    effect = [(0.35, 0.30), (0.25, 0.05), (0.20, 0.04), (0.20, 0.20)]

    def measure(plan):
        on = [effect[i] for i in range(4) if plan >> i & 1]
        return 1.0 + sum(e[1] for e in on), 1.0 - sum(e[0] for e in on)

    for _ in range(400):
        s.observe(*measure(s.plan))
        if s.converged:
            break
    fits = [p for p in range(16) if measure(p)[1] <= 0.6 + 1e-9]
    fastest = min(fits, key=lambda p: measure(p)[0])
    assert s.converged and s.within_budget(measure(s.plan)[1])
    assert s.plan == fastest == 0b0110  # segments 1 and 2: 45% saved for 9% more time
    assert all(s.within_budget(m) for p, (t, m) in s.measured.items() if p == s.best[1])
    assert s.plan_dict() == {"segment 0": False, "segment 1": True, "segment 2": True, "segment 3": False}


def test_a_plan_that_ran_out_of_memory_is_penalised_and_never_chosen_again():
    s = PlanLearner(range(3), seed=0)
    s._prev_plan, s._action, s.plan = 0, 0, 0b001  # as if the learner had just flipped unit 0
    s.penalise()
    assert s.plan == 0 and 0b001 in s.failed and s.q[0, 0] < -1 and not s.allowed(0, 0)
    assert all(s.choose(0) != 0 for _ in range(200))


@pytest.mark.parametrize("cap,start", [(1000, 128), (100, 128), (128, 128), (5000, 1), (1, 64), (0, 64)])
def test_largest_batch_search_finds_the_cap_within_a_sixteenth(cap, start):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= cap
    got = largest_batch(fits, start)
    assert got <= cap and (cap == 0 and got == 0 or got >= cap * 15 / 16)
    assert len(tried) < 40


def test_segments_cut_the_forward_into_parts_of_about_equal_bytes():
    class M:  # modules stand-ins, in forward order
        def __init__(self, n):
            self.n = n
    mods = [M(n) for n in (10, 10, 10, 10, 10, 10, 30, 10)]
    seg = segments({m: m.n for m in mods}, 3)
    assert [seg[m] for m in mods] == [0, 0, 0, 1, 1, 1, 2, 2]  # 30 + 30 + 40 of 100
    assert sorted(set(segments({m: m.n for m in mods}, 8).values())) == list(range(7))


def test_gain_from_given_times():
    assert cpu_gain(4.0, 1.0) == 0.25  # the CPU is 4x slower: it adds a quarter
    with pytest.raises(ValueError):
        cpu_gain(0.0, 1.0)


def run_probe(probe, clock, seconds_per_batch):
    """Feed the probe batches of 10 samples taking seconds_per_batch[on/off] each."""
    while probe.verdict is None:
        clock.t += seconds_per_batch["on" if probe.cpu_allowed else "off"]
        probe.count(10)


def test_on_off_probe_keeps_the_cpu_only_when_it_measurably_helps():
    for on, off, keep in ((0.010, 0.012, True), (0.012, 0.010, False), (0.0099, 0.0100, False)):
        clock = Clock()
        probe = OnOffProbe(windows=4, batches=5, min_gain=0.02, clock=clock)
        assert probe.cpu_allowed  # the first window is "on"
        run_probe(probe, clock, {"on": on, "off": off})
        assert probe.verdict is keep and probe.cpu_allowed is keep
        assert len(probe.rates["on"]) == len(probe.rates["off"]) == 2
        assert probe.rates["on"][0] == pytest.approx(10 / on) and probe.rates["off"][0] == pytest.approx(10 / off)


def test_an_off_window_starts_once_the_cpu_replica_is_idle():
    """The CPU replica's batch given in an "on" window may still run when the "off" window
    comes: the off window's clock starts only once it is done, so its tail is not counted
    as the cost of "off" (seen in CI: "off" windows of 473 and 611 samples/s against
    39,566 once the replica was idle, and the probe kept a replica that slowed training)."""
    clock = Clock()
    probe = OnOffProbe(windows=2, batches=2, min_gain=0.02, clock=clock)
    for _ in range(3):  # "on": a start and two batches of 10 samples, 0.1 s each
        clock.t += 0.1
        probe.count(10, cpu_busy=True)
    assert probe.rates["on"] == [pytest.approx(100)] and not probe.cpu_allowed
    for _ in range(5):  # the replica's batch still runs: slow batches, not counted
        clock.t += 1.0
        probe.count(10, cpu_busy=True)
    assert probe.rates["off"] == [] and probe.verdict is None
    for _ in range(3):  # idle now: the off window starts, then two batches of 0.01 s
        clock.t += 0.01
        probe.count(10)
    assert probe.rates["off"] == [pytest.approx(1000)] and probe.verdict is False
