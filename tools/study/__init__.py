"""This study's site helpers, note rules and note skeleton, which study.plugin registers with pin_and_cite."""
