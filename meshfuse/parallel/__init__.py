"""The parallelism strategies, a package each; see docs/design.md's map of the code."""
