"""Beside the runtime: the launcher of `pipecc run`, the model file, the reference, the profiler."""
