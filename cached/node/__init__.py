"""The node's wiring around the daemon: systemd, listening sockets, the health check, sizing
and the service's lifecycle."""
