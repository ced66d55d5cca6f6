"""Random ops (``rand``, ``randn``, ``uniform``, ``normal``, ``dropout``...) and the
counter-based random streams they and attention's dropout draw from. Importing it registers
the ops."""

from meshfuse.ops.random import declaration  # noqa: F401
