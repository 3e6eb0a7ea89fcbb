"""The paper's synthetic experiment as one command: train, generate blue and green groups, report."""
