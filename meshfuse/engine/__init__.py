"""The engine: runs a fusion on this rank (:class:`~meshfuse.engine.runner.FusionRunner`), the
one place where the core (build pipeline, interpreter, communication, replay) and the
parallelism strategies' runtime parts meet."""
