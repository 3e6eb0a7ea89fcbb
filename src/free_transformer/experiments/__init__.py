"""Experiments: sweeps of training runs (variants x seeds) that are measured and reported. `sweep` names
no experiment; `demo` (the paper's synthetic letters and coin flips) and `study` (the kappa study on
real text) are two definitions on it."""
