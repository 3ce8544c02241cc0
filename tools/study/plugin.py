"""The study site: the helpers this kit's notes use, registered with the renderer (which imports none of them).

`helpers` names each template global after the study module it comes from: traces and diagrams, estimates,
the Scale page's tables and calculator, the recorded Run it outputs. `PLUGIN` registers them with the renderer
(reading_notes/pins.toml names this module: pin_and_cite.site.plugin), with the rules this study's notes keep
(study.note_rules) and the skeleton of a new close reading (study.new_note).
"""

from __future__ import annotations

from pin_and_cite.core.context import Context
from pin_and_cite.site.plugin import Plugin
from study import diagrams, estimates, moe_tables, run_it, scale_calculator, scale_tables
from study.calibration import load_calibration
from study.new_note import skeleton
from study.note_rules import check_note
from study.traces import load_trace


def helpers(context: Context) -> dict:
    """The template globals of this study's notes, reading the checkout's committed traces."""

    def trace(name: str) -> dict:
        return load_trace(context.notes_dir, name)

    def diagram(
        name: str,
        measured: str | None = None,
        calibration: str | None = None,
        same_scale_as: str | None = None,
        **options,
    ) -> str:
        """The diagram of trace `name`; a timeline also draws the `measured` trace of the same step beside it,
        takes its FLOP rates from reading_notes/calibrations/`calibration`.json when named, and shares its time
        axis with the trace `same_scale_as` (a pipeline of the same model)."""
        extra = {"measured": trace(measured)} if measured else {}
        if same_scale_as:
            extra["same_scale_as"] = trace(same_scale_as)
        if calibration:
            extra["calibration"] = load_calibration(context.notes_dir, calibration)
        return diagrams.diagram(trace(name), **options, **extra)

    return {
        "trace": trace,
        "calibration": lambda name: load_calibration(context.notes_dir, name),
        "diagram": diagram,
        "tp_crossover": estimates.tp_crossover,
        "pipeline_memory": estimates.pipeline_memory,
        "pipeline_bubble": lambda name: estimates.pipeline_bubble(trace(name)),
        "sharding_limit": estimates.sharding_limit,
        "chart_training_memory": diagrams.chart_training_memory,
        "scale_table": scale_tables.scale_table,
        "sent_per_group": scale_tables.sent_per_group,
        "chart_sent_per_group": diagrams.chart_sent_per_group,
        "human": scale_tables.human,
        "memory_table": scale_tables.memory_table,
        "held_table": scale_tables.held_table,
        "moe_memory_table": moe_tables.moe_memory_table,
        "moe_imbalance_table": moe_tables.moe_imbalance_table,
        "scale_calculator": scale_calculator.scale_calculator,
        "run_output": lambda name: run_it.run_output(context.notes_dir, name),
        "run_text": lambda name: run_it.run_text(context.notes_dir, name),
    }


PLUGIN = Plugin(helpers=helpers, note_rules=check_note, skeleton=skeleton)
