"""The engine: the interpreter's loop and the primitives it dispatches to."""
