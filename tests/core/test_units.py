"""Byte units users type and read: binary vs decimal units, clear errors."""

import pytest

from lightning_memkit import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("80GB", 80 * 10**9),
        ("1.5KiB", 1536),
        ("8e9", 8 * 10**9),
        ("123", 123),
        (4096, 4096),
        ("2tib", 2 * 2**40),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["16 gigs", "", "GiB", "-1GiB", -5, True])
def test_parse_bytes_rejects_what_is_not_a_size_and_says_how_to_write_one(bad):
    with pytest.raises(ValueError, match="16GiB|negative|memory size"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(10745832) == "10.25 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(-2048) == "-2.00 KiB"
    assert format_bytes(None) == "-"
