"""Numerical core of `ladle calibrate`: calibration metrics and post-hoc calibrators.

`metrics` scores probability matrices P [n, k] against integer labels y [n];
`methods` fits small, JSON-serialisable calibrators (temperature, Platt, vector,
isotonic, contextual, PriDe) on option probabilities.

The calibrate tool talks to a running server over HTTP, so this package imports
nothing from ladle.engine, ladle.model or ladle.server, and nothing heavy here.
"""
