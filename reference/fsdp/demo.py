"""Placeholder: the fsdp demo (filled in by its issue)."""


def add_arguments(group) -> None:
    """Add this demo's flags to the shared parser's argument group."""


def run(args) -> None:
    raise SystemExit("reference: the fsdp demo is not implemented yet")
