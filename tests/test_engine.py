"""Process set-up helpers that need no process group."""

from __future__ import annotations

import pytest

from train.engine import plain_arch_list


@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),                       # what torch and some images preset on Hopper; DeepSpeed cannot parse it
    ("9.0a;8.0+PTX 10.0a", "9.0;8.0+PTX;10.0"),
    ("8.6", "8.6"),
    ("9.0;9.0a", "9.0"),
])
def test_plain_arch_list(value, expected):
    """Arch-specific suffixes are dropped, +PTX kept, duplicates merged."""
    assert plain_arch_list(value) == expected
