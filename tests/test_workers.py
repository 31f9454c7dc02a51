"""The worker processes that fuse candidates at once (`bbrules.workers`)."""

from __future__ import annotations

import operator
import os

import pytest

from bbrules.workers import WorkerError, run_all


def test_results_come_back_in_the_order_of_the_calls():
    calls = [(pow, (2, n)) for n in range(7)]
    assert run_all(calls, workers=3, initializer=int) == [2 ** n for n in range(7)]


def test_the_first_exception_by_call_order_is_raised():
    calls = [(operator.add, (1, 2)), (operator.truediv, (1, 0)), (operator.getitem, ([], 3))]
    with pytest.raises(ZeroDivisionError):
        run_all(calls, workers=2, initializer=int)


def test_an_initializer_that_fails_fails_every_call():
    with pytest.raises(ValueError, match="invalid literal"):
        run_all([(abs, (-1,))], workers=1, initializer=int, initargs=("not a number",))


def test_a_worker_that_dies_is_an_error_not_a_hang():
    with pytest.raises(WorkerError, match="exited without replying"):
        run_all([(abs, (-1,)), (os._exit, (3,))], workers=1, initializer=int)
