"""Evidence apart from the mechanism tests: upstream's own code run as the notes' evidence (marked `upstream`:
megatron-core, torch's FSDP1/FSDP2/DTensor, HF's Qwen2 under DTensor) and fresh re-recordings compared with the
committed traces and runs (marked `freshness`). `make test` runs them with the rest; `pytest tests/evidence`,
`pytest -m upstream` or `pytest -m freshness` runs them alone (the markers also select the few such tests that
share a launch or a fixture with mechanism tests in tests/reference)."""
