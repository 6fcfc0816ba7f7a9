"""Local stack: real servers and service processes on free loopback ports, stopped by PID.

Several hosts on one machine: `hosts.Hosts` (network namespaces on a bridge, root only) and
`cluster` (a JetStream cluster, Redis with a replica and Sentinel, across those hosts).
"""

from slipstream.stack.process import ManagedProcess, ProcessGroup, free_port, pid_alive, port_bindable, wait_port
from slipstream.stack.servers import Server, start_nats, start_redis, start_s3

__all__ = [
    "ManagedProcess",
    "ProcessGroup",
    "Server",
    "free_port",
    "pid_alive",
    "port_bindable",
    "start_nats",
    "start_redis",
    "start_s3",
    "wait_port",
]
