"""The subcommands of the `pipecc` command line, one module each.

Each module has `register(commands)`, which adds its subparser and sets `run(args) -> int`.
"""
