"""Communication: the communicator and its process groups, the collectives a program runs,
copy-engine transports and symmetric memory, and resharding, planned as steps and lowered to
collectives on this rank's groups."""
