"""Sandboxes for coding agents: isolated directory trees where commands run under limits, offline.

`SandboxProvider` / `Sandbox` (provider.py) are the interface; `BwrapProvider` (bwrap.py) the
default backend: bubblewrap namespaces, overlay layers for cheap forks, cgroups for limits.
"""

from slipstream.sandbox.bwrap import BwrapProvider, BwrapSandbox
from slipstream.sandbox.limits import ExecResult, Limits
from slipstream.sandbox.provider import Sandbox, SandboxError, SandboxProvider, Snapshot

__all__ = [
    "BwrapProvider",
    "BwrapSandbox",
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxError",
    "SandboxProvider",
    "Snapshot",
]
