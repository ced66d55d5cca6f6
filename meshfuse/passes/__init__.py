"""The build pipeline (``pipeline``): small passes over a private copy of a fusion, generic in
the parallelism strategies (which add their own passes by registering them)."""
