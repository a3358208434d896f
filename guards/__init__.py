"""Guards: which calls a compiled entry may serve, and the recompile policy (gjit.guards)."""

from gjit.guards.builder import Bind, Guard, GuardBuildError, GuardSet, build_guards, input_symbols
from gjit.guards.policy import MissHistory, dynamic_dims, mark_dynamic

__all__ = [
    "Bind",
    "Guard",
    "GuardBuildError",
    "GuardSet",
    "MissHistory",
    "build_guards",
    "dynamic_dims",
    "input_symbols",
    "mark_dynamic",
]
