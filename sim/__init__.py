"""Deterministic multi-rank simulator of the TP step protocol.

It drives the real `protocol` controller and workers against a model of the hazards that made
real engines hang or diverge (hazards.py), explores interleavings and faults (search.py), and
reports deadlock or divergence with a minimal, readable trace (report.py).
"""
