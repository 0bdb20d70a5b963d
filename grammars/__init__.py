"""Data package: the DSL grammar, shipped inside the wheel (loaded by pipecc.frontend)."""
