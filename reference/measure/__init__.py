"""Measurement of the reference: observers and tools that time, count and record, apart from the mechanisms."""
