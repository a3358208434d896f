"""Guards: which calls a compiled entry may serve (gjit.guards)."""

from gjit.guards.builder import Guard, GuardSet, build_guards

__all__ = ["Guard", "GuardSet", "build_guards"]
