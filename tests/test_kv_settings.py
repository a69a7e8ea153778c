"""pipeline/kv_settings.py: the torch engine's paged-cache settings check themselves and size the pool."""

from __future__ import annotations

import pytest

from pipeline.kv_settings import KVSettings


@pytest.mark.parametrize("kwargs, message", [({"block_size": 48}, "power of two"), ({"step_tokens": 0}, ">= 1"),
                                             ({"block_size": 64, "max_tokens": 32}, "at least one block")])
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVSettings(**kwargs)


def test_the_pool_holds_every_row_at_its_longest_unless_limited():
    assert KVSettings(block_size=16).max_blocks(max_batch=4, max_len=100, spare=5) == 4 * 7  # ceil(105 / 16)
    assert KVSettings(block_size=16, max_tokens=64).max_blocks(4, 100, 5) == 4  # a request longer is refused
    assert KVSettings(block_size=16, max_tokens=1024).max_blocks(4, 100, 5) == 64
