"""Every reference module that mirrors upstream code has a page mapping it, and the mapping cannot go stale."""

from __future__ import annotations

import re

import pytest

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.local_code import ours
from pin_and_cite.core.parse_cache import ParseCache
from tests.tools.conftest import ROOT

# Modules with no upstream counterpart to map, and why.
NO_PAGE = {
    "reference/__init__.py": "package marker",
    "reference/__main__.py": "the demo entry point",
    "reference/arguments.py": "the CLIs' argument checks; mirrors nothing upstream",
    "reference/measure/replay.py": "replays recorded schedule orders for their bubble; mirrors nothing upstream",
    "reference/distributed.py": "process-group start and clean teardown for demos, benchmarks and workers",
    "reference/heartbeat.py": "ends a job whose rank stopped answering; mirrors nothing upstream",
    "reference/layout.py": "the command that prints a layout (parallel_state.py has the page)",
    "reference/tensor_parallel/rotary.py": "rotary positions of the llama block; its oracle is HF Qwen2, not a pin",
    "reference/synthetic_data.py": "the random token batches every demo and test trains on; mirrors nothing",
    "reference/gpt/hf_weights.py": "maps HF Qwen2 weights onto the llama style; transformers is not a pinned source",
    "reference/gpt/demo.py": "demo",
    "reference/fsdp/demo.py": "demo",
    "reference/moe/demo.py": "demo",
    "reference/hf_tp/__main__.py": "the DTensor demo; its page is the DTensor walkthrough",
    "reference/hf_tp/plan.py": "DTensor's plans on HF Qwen2, not our code; the DTensor close reading reads them",
    "reference/measure/comm_bytes.py": "CommDebugMode that keeps bytes, for the DTensor demo; recorder.py has the page",
    "reference/measure/fsdp_tracing.py": "recorder scopes for the FSDP demo and tests",
    "reference/fsdp/units.py": "wraps a model unit by unit for demos, tests and benchmarks (wrapper.py has the page)",
    "reference/measure/torch_patches.py": "every patch of torch internals; each docstring names the upstream code",
    "reference/measure/scale/__main__.py": "the scale-simulation command",
    "reference/measure/scale/shapes.py": "model and layout sizes for the simulation; its page is the Scale note",
    "reference/measure/scale/formulas.py": "the closed-form traffic the simulation is checked against (Scale note)",
    "reference/measure/scale/simulate.py": "traces one rank of a large job; its page is the Scale note",
    "reference/measure/scale/grid.py": "the closed forms over a grid of layouts for the Scale note's calculator",
    "reference/measure/scale/moe_shapes.py": "MoE model and layout sizes for the simulation; see the Scale note",
    "reference/measure/scale/routing.py": "the stated routing skew of the MoE simulation; see the Scale note",
    "reference/measure/scale/moe_formulas.py": "the MoE layers' closed-form traffic (the Scale note's MoE section)",
    "reference/measure/scale/moe_simulate.py": "traces one rank's MoE layers; its page is the Scale note",
    "reference/measure/scale/moe_report.py": "the MoE branch of the scale-simulation command",
    "reference/measure/activation_memory/counting.py": "counts saved tensors with saved_tensors_hooks",
    "reference/measure/activation_memory/paper.py": "Korthikanti et al.'s Table 2; see the Scale note's section",
    "reference/measure/activation_memory/gpt2_block.py": "the term table against the paper; see the Scale note",
    "reference/measure/activation_memory/llama_block.py": "the Llama block's closed form by term; see the Scale note",
    "reference/measure/activation_memory/term_table.py": "the Row and tally both blocks' term tables share",
    "reference/measure/activation_memory/measure.py": "builds and counts each configuration for tests and benchmark",
    "reference/measure/pipeline_meter.py": "the observer the pipeline schedules take; mirrors nothing upstream",
    "reference/measure/calibrate.py": "times this device's ops for the modeled timelines; mirrors nothing upstream",
}


def test_every_reference_module_has_a_page():
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "reference").rglob("*.py"))
    missing = [
        m
        for m in modules
        if m not in NO_PAGE
        and not m.endswith("/__init__.py")
        and not (
            ROOT
            / "reading_notes"
            / "reference"
            / (m.removeprefix("reference/").removesuffix(".py").replace("/", ".") + ".md.j2")
        ).is_file()
    ]
    assert missing == [], "write reading_notes/reference/<module>.md.j2 for these (or list them in NO_PAGE)"


def test_ours_points_at_the_definition_and_refuses_a_stale_name(tmp_path):
    parsed = ParseCache(tmp_path)
    text = ours(ROOT, "reference/tensor_parallel/mappings.py::_CopyToTensorParallelRegion", parsed)
    first = next(
        i
        for i, line in enumerate((ROOT / "reference/tensor_parallel/mappings.py").read_text().split("\n"), 1)
        if line.startswith("class _CopyToTensorParallelRegion")
    )
    assert text.startswith(f"`_CopyToTensorParallelRegion` (reference/tensor_parallel/mappings.py L{first}–L")
    with pytest.raises(PinAndCiteError, match="symbol 'renamed' is not defined in reference/fsdp/runtime.py"):
        ours(ROOT, "reference/fsdp/runtime.py::renamed", parsed)
    with pytest.raises(PinAndCiteError, match="does not exist"):
        ours(ROOT, "reference/gone.py::x", parsed)


def test_a_reference_page_links_each_mapped_definition_to_its_code_shown_on_the_page():
    """Finding: reference pages showed a mapping table but neither the reference code nor a link to it. Each
    `ours()` in the table links to an anchor on the page, where the definition is shown with our file's line
    numbers, so the reader sees the reference beside the upstream lines it mirrors."""
    from pin_and_cite.core.project import Project
    from pin_and_cite.site.render import Renderer

    project = Project(ROOT)
    page = Renderer(project).render(project.notes_dir / "reference" / "data_parallel.buckets.md.j2")
    source = (ROOT / "reference/data_parallel/buckets.py").read_text().split("\n")
    links = re.findall(r"\| \[`([\w.]+)` \(reference/data_parallel/buckets\.py L(\d+)–L(\d+)\)\]\(#([\w-]+)\) \|", page)
    assert [name for name, *_ in links] == [
        "bucket_layout",
        "GradBucket.start_grad_sync",
        "GradBucket.finish_grad_sync",
    ]
    for _, first, last, anchor in links:
        assert page.count(f'id="{anchor}"') == 1
        shown = page.split(f'id="{anchor}"', 1)[1]
        fence = re.search(r'\n(`{3,})python linenums="(\d+)"\n', shown)
        assert fence and fence[2] == first
        code = shown[fence.end() :].split(f"\n{fence[1]}\n", 1)[0]
        assert code.split("\n") == source[int(first) - 1 : int(last)]
