"""The site: render the note templates, and this study's helpers (traces, diagrams, estimates, scale tables),
which pin_and_cite.site.study registers with the renderer. Imports the core and the relocation engine.
"""
