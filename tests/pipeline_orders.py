"""The action order the textbook gives each pipeline stage, written out apart from any implementation: the
oracle of both the live pipeline runs (tests/reference/test_pipeline.py) and the recorded ones
(tests/tools/test_traces.py)."""


def textbook(schedule: str, p: int, r: int, m: int) -> list[str]:
    """Stage r of p's forwards F<i> and backwards B<i> over m micro-batches. GPipe: every forward, then every
    backward; 1F1B: p - 1 - r warm-up forwards, then one forward and one backward in turn, then the remaining
    backwards. A single stage (p = 1) runs each micro-batch's backward right after its forward under both."""
    if p == 1:
        return [a for i in range(m) for a in (f"F{i}", f"B{i}")]
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    w = min(p - 1 - r, m)
    return (
        [f"F{i}" for i in range(w)]
        + [a for i in range(m - w) for a in (f"F{w + i}", f"B{i}")]
        + [f"B{i}" for i in range(m - w, m)]
    )
