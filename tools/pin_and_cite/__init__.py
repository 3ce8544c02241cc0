"""pin-and-cite: pin upstream repositories, fetch exactly the cited files, and verify every citation.

The lock (reading_notes/citations.lock) is to the notes what go.sum is to a Go module: it records the git
blob SHA of every cited file and a hash of every cited range, so any source that can reproduce those bytes
(cache, installed wheel, partial git fetch) is as good as any other, and `check` needs no network.
"""
