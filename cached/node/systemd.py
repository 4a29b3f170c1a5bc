"""systemd integration without a dependency: sd_notify and socket activation.

``notify("READY=1")`` sends one datagram to ``$NOTIFY_SOCKET`` (a path, or an abstract
name written ``@name``); without that variable it does nothing, so the same daemon runs
under systemd, in a container and from a shell. ``listen_fds()`` returns the sockets
systemd passed (``$LISTEN_PID`` equal to our pid, ``$LISTEN_FDS`` descriptors from 3)
and unsets the variables so no child inherits them. ``watchdog_interval()`` is half of
``$WATCHDOG_USEC`` (when it names this process), the period to send ``WATCHDOG=1`` at.
"""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


def notify(*lines: str) -> bool:
    """Send ``KEY=VALUE`` lines to the service manager; False when there is none."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not lines:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
    except OSError:
        return False
    return True


def listen_fds(unset: bool = True) -> list[socket.socket]:
    """The listening sockets passed by systemd (or ``systemd-socket-activate``)."""
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    if unset:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(name, None)
    if pid != os.getpid() or count < 1:
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))
    return sockets


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half the configured timeout), or None."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    return usec / 2e6
