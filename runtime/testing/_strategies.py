"""Scheduling strategies of the deterministic runtime: random, PCT, replay.

A strategy picks, at each step, which runnable actor handles its next mail
(choices are sorted names, plus `timer:<name>` when timers race). Given the same
seed and the same sequence of choice sets it makes the same picks.

PCT (Burckhardt et al., "A Randomized Scheduler with Probabilistic Guarantees of
Finding Bugs", ASPLOS 2010): every actor gets a distinct random priority; `depth -
1` change points are drawn uniformly from the first `steps` steps; the runnable
actor with the highest priority runs; at the i-th change point the actor that
runs has its priority lowered below every initial one. For a bug of depth `d` (it
shows when `d` ordering constraints hold) among `n` actors and `k` steps, one run
finds it with probability at least `1 / (n * k^(d-1))`; real bugs of actor
systems are mostly of depth 1 or 2, so a few dozen schedules find them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class Strategy(Protocol):
    name: str

    def choose(self, step: int, choices: Sequence[str]) -> str:
        """One of `choices` (sorted, non-empty) for step number `step`."""
        ...


class RandomStrategy:
    """Uniformly random among the runnable actors."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(f"random:{seed}")

    def choose(self, step: int, choices: Sequence[str]) -> str:
        return choices[self._rng.randrange(len(choices))]


class PCTStrategy:
    """Priority change points of depth `depth` over the first `steps` steps."""

    name = "pct"

    def __init__(self, seed: int, *, depth: int = 2, steps: int = 2000) -> None:
        if depth < 1 or steps < 1:
            raise ValueError(f"PCT needs depth >= 1 and steps >= 1, got depth={depth}, steps={steps}")
        self.depth = depth
        self.steps = steps
        self._rng = random.Random(f"pct:{seed}")
        self._priority: dict[str, float] = {}
        points = sorted(self._rng.sample(range(1, steps + 1), min(depth - 1, steps)))
        # change point step -> the low priority it assigns (lower for later points)
        self._change = {step: -(i + 1) for i, step in enumerate(points)}

    def choose(self, step: int, choices: Sequence[str]) -> str:
        for c in choices:
            if c not in self._priority:
                self._priority[c] = self._rng.random() + 1.0  # initial priorities are in [1, 2)
        pick = max(choices, key=lambda c: (self._priority[c], c))
        low = self._change.get(step)
        if low is not None:
            self._priority[pick] = float(low)
            pick = max(choices, key=lambda c: (self._priority[c], c))
        return pick


class ScheduleDivergedError(RuntimeError):
    """A replayed schedule asked for an actor that has no mail at that step."""


class ReplayStrategy:
    """Replays recorded choices; past their end it falls back to the lowest name."""

    name = "replay"

    def __init__(self, choices: Sequence[str]) -> None:
        self._choices = list(choices)

    def choose(self, step: int, choices: Sequence[str]) -> str:
        if step >= len(self._choices):
            return choices[0]
        want = self._choices[step]
        if want not in choices:
            raise ScheduleDivergedError(
                f"step {step}: the recorded schedule picks {want!r} but only {list(choices)} can run; "
                "the code or the inputs differ from the recorded run"
            )
        return want
