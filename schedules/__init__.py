"""Data package: the bundled .sched schedules, shipped inside the wheel (see `pipecc list`)."""
