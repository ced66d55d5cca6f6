"""Failure handling: typed failures of a rank's program, errors raised on one rank only (so
that the others do not wait for it in a collective), and the notice board they post to."""
