"""The study site: the helpers this kit's notes use, registered with the renderer (which imports none of them).

`trace(name)` with `diagram(name, ...)` (a timeline at a device's measured rates with `calibration="NAME"`;
`calibration(NAME)` is the file itself, pin_and_cite.site.calibration), `tp_crossover(...)`,
`pipeline_memory(...)` and `pipeline_bubble(name)` (recorded runs, pin_and_cite.site.traces), `sharding_limit(...)` with
`chart_training_memory(...)` (per-rank training memory from formulas, pin_and_cite.site.estimates),
`scale_table(trace)`, `memory_table(trace, trace)`, `held_table(trace, ...)`, `sent_per_group(trace, run)` and
`human(bytes)` (the Scale page, pin_and_cite.site.scale_tables; a MoE trace's `moe_memory_table(*traces)` and
`moe_imbalance_table(*traces)`, pin_and_cite.site.moe_tables) with `chart_sent_per_group(trace)` (its bar
charts, diagrams) and `scale_calculator(trace)` (its calculator over a layout grid,
pin_and_cite.site.scale_calculator), and `run_output(NAME)`, the recorded output a walkthrough shows under its
Run it block, and `run_text(NAME)`, that output as text to quote numbers from (pin_and_cite.site.run_it).
`render_site` is what `render` and the mkdocs hook run.
"""

from __future__ import annotations

from pathlib import Path

from pin_and_cite.core.project import Project
from pin_and_cite.site import diagrams, estimates, moe_tables, run_it, scale_calculator, scale_tables
from pin_and_cite.site.calibration import load_calibration
from pin_and_cite.site.render import render_notes
from pin_and_cite.site.traces import load_trace


def helpers(project: Project) -> dict:
    """The template globals of this study's notes, reading `project`'s committed traces."""

    def trace(name: str) -> dict:
        return load_trace(project.notes_dir, name)

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
            extra["calibration"] = load_calibration(project.notes_dir, calibration)
        return diagrams.diagram(trace(name), **options, **extra)

    return {
        "trace": trace,
        "calibration": lambda name: load_calibration(project.notes_dir, name),
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
        "run_output": lambda name: run_it.run_output(project.notes_dir, name),
        "run_text": lambda name: run_it.run_text(project.notes_dir, name),
    }


def render_site(root: Path, out_dir: Path) -> list[Path]:
    """render_notes with this study's helpers: every page of the site, the files that changed."""
    return render_notes(root, out_dir, helpers)
