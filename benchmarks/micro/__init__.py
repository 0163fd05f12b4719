"""Micro-benchmarks: one part of the engine (a local step, a reduction, a round's host work)
timed alone."""
