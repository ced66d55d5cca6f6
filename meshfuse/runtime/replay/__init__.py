"""CUDA-graph replay: programs captured once (``cuda_graph=True``), the automatic replay of
cached programs, and the random streams that stay right across replays."""
