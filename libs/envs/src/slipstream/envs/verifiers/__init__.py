"""verifiers v1 environments on Slipstream: the `verifiers` environment (env.py), the loopback
generate route and runner process it plays through (bridge.py), and the runner itself (runner.py,
run under verifiers' own interpreter)."""
