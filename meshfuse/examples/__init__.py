"""Example fusions shared by the demo, the tests and the benchmarks."""
