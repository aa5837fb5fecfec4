"""The scaling ladder: plan small rungs from a target, train them, fit scaling laws, predict the
target's trajectory and guard the live run against it (docs/reference.md#the-scaling-ladder)."""
