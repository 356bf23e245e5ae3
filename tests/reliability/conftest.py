"""Shared set-up of the reliability suite."""
