"""Slipstream eval-gate service."""
