"""Running a built fusion: binding, the per-rank program, communication."""
