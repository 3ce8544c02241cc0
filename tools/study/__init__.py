"""This study's site helpers, registered with pin_and_cite by study.plugin (reading_notes/pins.toml names it):
the traces and what is drawn and computed from them (traces, timeline, diagrams, moe_figure, modeled,
calibration, estimates, scale_tables, moe_tables, scale_calculator), the recorded Run it outputs (run_it), the
rules this study's notes keep (note_rules) and a new close reading's skeleton (new_note). Imports pin_and_cite,
never the reference nor torch; the recorders that run the reference (tools/record_traces.py and the workers it
launches) import from here.
"""
