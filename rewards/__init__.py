"""Verifiers (reward functions) and the plug-in loader. Light to import: math-verify loads only with `math`."""

from rewards.deadline import CheckTimeout, call_with_deadline
from rewards.loader import BUILTINS, Verifier, VerifierLoadError, load_verifier, probe

__all__ = ["BUILTINS", "CheckTimeout", "Verifier", "VerifierLoadError", "call_with_deadline", "load_verifier", "probe"]
