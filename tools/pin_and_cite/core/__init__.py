"""The citation core: pins, the lock, the cache, fetching, resolving a citation to verified text, and the
note templates' written calls. Imports nothing from pin_and_cite.relocation or pin_and_cite.site.
"""
