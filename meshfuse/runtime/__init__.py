"""Running a per-rank program, in four packages, each importing only those after it:
``replay`` (CUDA graphs), ``interpreter`` (the program and its execution), ``comm``
(communication) and ``faults`` (failure handling)."""
