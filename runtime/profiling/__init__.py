"""Profiling: the interpreter that times every instruction, and the cost file it writes."""
