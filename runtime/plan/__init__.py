"""Binding a program to this rank: options, the plan walked, chunks and their checks."""
