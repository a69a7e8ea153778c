"""pipeline/executor/huge_pages.py: an arena hands out aligned copies that live as long as they are used, refuses
what does not fit, and says why where huge pages cannot be asked for."""

from __future__ import annotations

import gc

import pytest
import torch

from pipeline.executor import huge_pages


def test_copies_are_equal_aligned_and_outlive_the_arena_object():
    arena = huge_pages.Arena(4096)
    a = torch.arange(10, dtype=torch.float32).view(2, 5)
    b = torch.randn(3, dtype=torch.bfloat16)
    got_a, got_b = arena.copy(a), arena.copy(b)
    assert torch.equal(got_a, a) and got_a.shape == (2, 5) and got_a.is_contiguous()
    assert torch.equal(got_b, b) and got_b.dtype == torch.bfloat16
    assert (got_b.data_ptr() - got_a.data_ptr()) % huge_pages.ALIGN == 0 and got_b.data_ptr() > got_a.data_ptr()
    del arena
    gc.collect()
    got_a.add_(1)  # the mapping is still there
    assert torch.equal(got_a, a + 1)


def test_what_does_not_fit_is_refused():
    arena = huge_pages.Arena(128)
    arena.copy(torch.zeros(16))
    with pytest.raises(ValueError, match="do not fit"):
        arena.copy(torch.zeros(32))


def test_where_huge_pages_cannot_be_asked_for_it_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv(huge_pages.OFF_SWITCH, raising=False)
    setting = tmp_path / "enabled"
    assert "cannot be read" in huge_pages.unavailable(setting)
    setting.write_text("always madvise [never]\n")
    assert "off" in huge_pages.unavailable(setting)
    setting.write_text("always [madvise] never\n")
    assert huge_pages.unavailable(setting) is None
    monkeypatch.setenv(huge_pages.OFF_SWITCH, "1")
    assert "turned off" in huge_pages.unavailable(setting)
