"""The relocation engine: carry citations to a new pin (`bump`, `review`, `relocate`). Imports the core,
nothing from pin_and_cite.site.
"""
