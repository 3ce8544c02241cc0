"""Measurement, kept out of the mechanisms: they never import this package; it attaches to them.

`recorder.py` (every collective, FLOPs and compute spans), `pipeline_meter.py` (the observer a pipeline
schedule takes: action timing, FLOPs, in-flight micro-batches, bubble), `in_flight.py` (activations autograd
keeps alive), `fsdp_tracing.py` (FSDP collectives and compute by unit), `replay.py` (a recorded order's bubble
under uniform costs), `scale/` (one rank of a large job, traced), `activation_memory/` (saved bytes per
layer against Korthikanti et al.), `cp_blocks.py` (the blocks each cp rank's ring attention computes per ring
step, through the ring's observer) and `calibrate.py` (this device's compute rates for the modeled timelines).
"""
