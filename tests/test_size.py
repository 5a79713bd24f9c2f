"""booktools/size.py counts what issue 33's bounds count: code lines outside docstrings and
comments, and docstring lines, checked on a sample counted by hand."""

from booktools.size import count

SAMPLE = '''"""A module docstring
on two lines."""

import os  # a comment


# a comment alone
def f(x):
    """One line."""
    y = (x +
         1)
    return y


class C:
    """Two
    lines."""
    z = """a string that is
    not a docstring"""
'''


def test_code_and_docstring_lines_of_a_sample_counted_by_hand():
    # code: import (4), def (8), y = ( (10), 1) (11), return (12), class (15), z = (18), its 2nd line (19)
    # docstrings: 1-2, 9, 16-17
    assert count(SAMPLE) == (8, 5)
