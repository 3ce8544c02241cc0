"""The site: render the note templates, with the helpers and note rules the project's plugin registers
(pin_and_cite.site.plugin). Imports the core and the relocation engine.
"""
