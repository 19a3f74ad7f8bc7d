"""The exact-objective benchmark behind `kl-adapters demo` (see problem.py for the setup)."""
