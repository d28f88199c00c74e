"""The ctypes mirror of attnres_params is checked against the library's own layout."""

from __future__ import annotations

import ctypes

import pytest

from block_attnres import _native


def library_layout():
    return _native._library_layout(_native._lib)


def test_mirror_matches_the_library():
    fields, size = library_layout()
    assert _native.params_layout() == fields
    assert ctypes.sizeof(_native._Params) == size
    # The fields the header documents for ABI 3 are all there, at the end.
    assert [name for name, _, _ in fields[-3:]] == ["partial_update", "new_partial",
                                                    "grad_partial_in"]
    _native.check_params_layout(_native.params_layout(), size, fields, size)


@pytest.mark.parametrize("change,expected", [
    (lambda f: f[:7] + [(f[7][0], f[7][1] + 8, f[7][2])] + f[8:], r"offset \d+, size"),
    (lambda f: f[:3] + [(f[3][0], f[3][1], 4)] + f[4:], r"size 4.*size 8"),
    (lambda f: f[:2] + [("numblocks",) + f[2][1:]] + f[3:], r"'numblocks'"),
    (lambda f: f[:-1], r"no field"),
])
def test_a_wrong_layout_is_refused(change, expected):
    fields, size = library_layout()
    doctored = change(list(fields))
    with pytest.raises(ImportError, match=expected) as info:
        _native.check_params_layout(doctored, size, fields, size)
    # The message names the first field that differs and gives both layouts' values.
    index = next(i for i, (a, b) in enumerate(zip(doctored + [None], fields)) if a != b)
    message = str(info.value)
    assert f"field {index}:" in message and repr(fields[index][0]) in message, message
    assert f"offset {fields[index][1]}, size {fields[index][2]}" in message, message


def test_a_wrong_size_is_refused():
    fields, size = library_layout()
    with pytest.raises(ImportError, match=rf"{size + 8} bytes.*{size}"):
        _native.check_params_layout(fields, size + 8, fields, size)
