"""The per-rank program: binding of extents and local layouts, the ranks' agreement on their
inputs, the program's ``Step`` records and their executor, fused segments, allreduce buckets."""
