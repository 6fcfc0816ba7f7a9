"""Slipstream rollout-worker service."""
