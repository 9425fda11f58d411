"""Waiting out an unavailable store: `Retrying` calls each operation again
under its label, for as long as its deadline allows, and nothing else."""

import logging

import pytest

from colonnade.store import NotFound, StoreUnavailable
from colonnade.store.retry import Retrying

log = logging.getLogger("test.retry")


def _flaky(failures: int, calls: list):
    """An operation the store refuses `failures` times, then answers."""

    def op(*args, **kwargs):
        calls.append((args, kwargs))
        if len(calls) <= failures:
            raise StoreUnavailable(f"down ({len(calls)})")
        return "answer"

    return op


def test_an_operation_is_called_again_until_the_store_answers(caplog):
    calls, slept = [], []
    retrying = Retrying(log, 60.0, sleep=slept.append, put=_flaky(2, calls))
    with caplog.at_level(logging.WARNING, logger="test.retry"):
        assert retrying.put("k", data=b"x") == "answer"
    assert calls == [(("k",), {"data": b"x"})] * 3  # the same arguments each time
    assert slept == [0.5, 1.0]  # the shared backoff
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "store unavailable (put, attempt 1)",
        "store unavailable (put, attempt 2)",
    ]


def test_past_the_deadline_the_label_names_the_outage():
    calls, slept = [], []
    retrying = Retrying(log, -1.0, sleep=slept.append, ledger=_flaky(5, calls))
    with pytest.raises(StoreUnavailable, match=r"^ledger: store unavailable for \d+ s: down \(1\)"):
        retrying.ledger()
    assert len(calls) == 1 and slept == []


def test_other_store_errors_are_not_retried():
    slept = []

    def missing():
        raise NotFound("k")

    retrying = Retrying(log, 60.0, sleep=slept.append, get=missing)
    with pytest.raises(NotFound):
        retrying.get()
    assert slept == []


def test_only_the_operations_given_can_be_called():
    retrying = Retrying(log, 60.0, guard=lambda: 0)
    assert retrying.guard() == 0
    with pytest.raises(AttributeError, match="no store operation 'publish'"):
        retrying.publish()
    assert not hasattr(retrying, "__deepcopy__")  # dunder lookups do not reach the table
