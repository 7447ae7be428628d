"""A hypothesis state machine of the node ledger against a model: three handles on one
ledger (three "processes"), reserving, trying, releasing and closing in any order; the
ledger always says what the model says and never shows more than the budget."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from async_stager._core.memory.ledger import NodeLedger, Reservation
from async_stager.errors import NodeBudgetError

pytestmark = pytest.mark.timeout(120)

BUDGET = 1000


class LedgerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "led")
        self.handles = [NodeLedger.open(BUDGET, path=self.path) for _ in range(3)]
        self.open = [True, True, True]
        self.held: list[list[Reservation]] = [[], [], []]

    def total(self) -> int:
        return sum(r.nbytes for i, rs in enumerate(self.held) if self.open[i] for r in rs)

    def live(self) -> list[int]:
        return [i for i in range(3) if self.open[i]]

    @precondition(lambda self: any(self.open))
    @rule(data=st.data(), n=st.integers(0, 1200))
    def try_reserve(self, data: st.DataObject, n: int) -> None:
        i = data.draw(st.sampled_from(self.live()))
        if n > BUDGET:
            with pytest.raises(NodeBudgetError):
                self.handles[i].try_reserve(n)
            return
        r = self.handles[i].try_reserve(n)
        assert (r is not None) == (self.total() + n <= BUDGET)
        if r is not None:
            self.held[i].append(r)

    @precondition(lambda self: any(self.open))
    @rule(data=st.data(), n=st.integers(0, 400))
    def reserve_with_a_short_bound(self, data: st.DataObject, n: int) -> None:
        i = data.draw(st.sampled_from(self.live()))
        fits = self.total() + n <= BUDGET
        if fits:
            self.held[i].append(self.handles[i].reserve(n, timeout=0.0))
        else:
            with pytest.raises(NodeBudgetError):
                self.handles[i].reserve(n, timeout=0.0)

    @precondition(lambda self: any(self.held[i] for i in range(3)))
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data: st.DataObject, twice: bool) -> None:
        i = data.draw(st.sampled_from([i for i in range(3) if self.held[i]]))
        r = self.held[i].pop(data.draw(st.integers(0, len(self.held[i]) - 1)))
        r.release()
        if twice:
            r.release()

    @precondition(lambda self: sum(self.open) > 1)
    @rule(data=st.data())
    def close_one(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.live()))
        self.handles[i].close()
        self.open[i] = False
        for r in self.held[i]:
            r.release()  # a no-op now
        self.held[i] = []

    @invariant()
    def agrees_with_the_model(self) -> None:
        i = self.live()[0]
        u = self.handles[i].usage()
        assert u.reserved == self.total() <= BUDGET
        assert u.waiting == ()
        assert u.peak <= BUDGET

    def teardown(self) -> None:
        for h in self.handles:
            h.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestLedgerModel = LedgerModel.TestCase
TestLedgerModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
