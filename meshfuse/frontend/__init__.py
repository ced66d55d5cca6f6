"""The user-facing definition API: FusionDefinition, ``fd.ops``, ``fd.sched``."""
