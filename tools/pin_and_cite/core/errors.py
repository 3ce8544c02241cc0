"""The one exception the CLI turns into a one-line error and an exit code (tracebacks are for bugs), and the
escaping that keeps such a line one line whatever input it echoes."""

BAD_INPUT = 2  # the user's arguments, pins or notes are wrong
UNAVAILABLE = 3  # a source could not deliver verified bytes (network, integrity)
LOCAL_IO = 4  # a local file could not be read or written (disk full, permissions)


class PinAndCiteError(Exception):
    """A problem the user can fix; `str()` is the whole message, one line."""

    def __init__(self, message: str, exit_code: int = BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


class SourceUnavailable(PinAndCiteError):
    def __init__(self, message: str):
        super().__init__(message, UNAVAILABLE)


def printable(text: str) -> str:
    """`text` with every character str.isprintable() refuses (control characters such as newline and escape,
    bidi overrides such as U+202E, line separators, surrogates from undecodable file names) written as its
    Python escape, so a path or citation echoed from input cannot forge a second line or reorder the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
