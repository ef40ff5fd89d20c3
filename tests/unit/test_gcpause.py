"""The collector paused for a bulk read comes back as it was, after errors and nesting too."""

from __future__ import annotations

import gc

import pytest

from gpuwarden.accounting.gcpause import paused


def test_the_collector_is_paused_inside_and_back_after() -> None:
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still reads in bulk
    assert gc.isenabled()


def test_an_error_inside_gives_the_collector_back() -> None:
    with pytest.raises(ValueError, match="boom"), paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off() -> None:
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_as_a_decorator_it_pauses_each_call() -> None:
    @paused()
    def inside() -> bool:
        return gc.isenabled()
    assert inside() is False
    assert gc.isenabled()
