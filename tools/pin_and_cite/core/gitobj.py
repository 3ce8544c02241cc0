"""Git object identity: the blob SHA is how every byte is proven, whoever delivered it."""

import hashlib
import re

FULL_SHA = re.compile(r"[0-9a-f]{40}")


def blob_sha(data: bytes) -> str:
    """The SHA-1 git gives `data` as a blob (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_full_sha(text: str) -> bool:
    return FULL_SHA.fullmatch(text) is not None
