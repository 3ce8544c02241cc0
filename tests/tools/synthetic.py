"""Synthetic upstream text shared by the relocation tests: a small module, and edits applied to it exactly."""

BASE = '''\
"""Module docstring."""
import functools


def traced(fn):
    return fn


class Column:
    """Splits the output dimension."""

    def __init__(self, size):
        self.size = size
        self.weight = [0] * size

    def forward(self, x):
        y = x * 2
        y = y + 1
        return y

    def backward(self, grad):
        return grad


def helper(a, b):
    total = a + b
    total = total * 2
    return total


def other(a):
    return a
'''
# Line numbers in BASE: Column 9-22, Column.forward 16-19 (body 17-19), helper 25-28, other 31-32.


HEADER = "# one\n# two\n# three\n"


def lines(text: str) -> list[str]:
    return text.split("\n")[:-1]


def edited(*replacements: tuple[str, str], text: str = BASE) -> str:
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text
