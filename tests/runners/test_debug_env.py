"""CIRCUIT_DEBUG is one graded knob: 0-3 or unset; anything else is refused, never ignored."""
from __future__ import annotations

import pytest

from draft_circuit.runners.program import DebugLevelError, debug_level


@pytest.mark.parametrize("text,level", [("", 0), ("0", 0), ("1", 1), (" 2 ", 2), ("3", 3)])
def test_debug_levels(monkeypatch, text, level):
    monkeypatch.setenv("CIRCUIT_DEBUG", text)
    assert debug_level() == level


def test_unset_is_zero(monkeypatch):
    monkeypatch.delenv("CIRCUIT_DEBUG", raising=False)
    assert debug_level() == 0


@pytest.mark.parametrize("text", ["abc", "4", "-1", "1.5", "yes"])
def test_bad_debug_level_is_refused(monkeypatch, text):
    monkeypatch.setenv("CIRCUIT_DEBUG", text)
    with pytest.raises(DebugLevelError, match=repr(text).replace("'", ".")):
        debug_level()
