"""Correctness on the device against float64 references, and the cost of the checks."""
