"""What one request or one client may cost the others: the server's limits, each a flag.

A server has one engine thread and one event loop for everyone, so anything a
single client can make large — a list of stop strings scanned at every token,
browsers watching the live view, a connection that never finishes its request —
is a cost every other request pays. Each limit below bounds one such cost; its
default is what `stagewise serve` uses, and its flag changes it:

    max_stop_strings     16      --max-stop-strings     stop strings per request (OpenAI allows 4)
    max_stop_length      256     --max-stop-length      characters per stop string
    max_view_subscribers 32      --max-view-subscribers open /api/events streams; one more gets 503
    view_publish_hz      10      --view-publish-hz      live-view snapshots a second (a recording
                                                        keeps every step)
    view_history_steps   600     --view-history-steps   snapshots /api/history keeps ...
    view_history_mb      8       --view-history-mb      ... and at most this many MB of them
    header_timeout_s     60      --header-timeout       seconds from a connection's first byte (or
                                                        its opening) to the end of a request's headers
    idle_timeout_s       60      --idle-timeout         seconds a request's body may pause

`allowed_hosts` (--allowed-hosts) is not a cost but a door: the names a
browser may reach the server by (see `host_allowed`).
"""

import ipaddress
import math
from dataclasses import dataclass, fields

from stagewise.errors import StagewiseError

LOCAL_NAMES = ("localhost",)  # names always allowed in the Host header


@dataclass(frozen=True)
class ServerLimits:
    max_stop_strings: int = 16  # stop strings one request may give; more are refused (400)
    max_stop_length: int = 256  # characters per stop string; a longer one is refused (400)
    max_view_subscribers: int = 32  # /api/events streams open at once; one more is refused (503)
    view_publish_hz: float = 10.0  # live-view snapshots per second, at most (0: every step)
    view_history_steps: int = 600  # snapshots kept for /api/history ...
    view_history_mb: float = 8.0  # ... and at most this many MB of their JSON
    header_timeout_s: float = 60.0  # a request's headers must be complete this long after it starts
    idle_timeout_s: float = 60.0  # a request body that pauses longer is answered 408
    allowed_hosts: tuple[str, ...] = ()  # names (besides localhost and IP literals) the Host may be; "*": any

    def __post_init__(self) -> None:
        flags = {
            "max_stop_strings": "--max-stop-strings",
            "max_stop_length": "--max-stop-length",
            "max_view_subscribers": "--max-view-subscribers",
            "view_history_steps": "--view-history-steps",
        }
        for name, flag in flags.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StagewiseError(f"{flag} must be an integer >= 1, got {value!r}")
        positive = {
            "view_history_mb": "--view-history-mb",
            "header_timeout_s": "--header-timeout",
            "idle_timeout_s": "--idle-timeout",
        }
        for name, flag in positive.items():
            value = getattr(self, name)
            if not _number(value) or not (0 < value < math.inf):
                raise StagewiseError(f"{flag} must be a finite number > 0, got {value!r}")
        if not _number(self.view_publish_hz) or not (0 <= self.view_publish_hz < math.inf):
            raise StagewiseError(f"--view-publish-hz must be a finite number >= 0, got {self.view_publish_hz!r}")
        hosts = tuple(h.strip().lower().rstrip(".") for h in self.allowed_hosts)
        for host in hosts:
            if not host or any(c in host for c in " /:@[]"):
                raise StagewiseError(f"--allowed-hosts takes host names (or '*'), got {host!r}")
        object.__setattr__(self, "allowed_hosts", hosts)

    @property
    def view_history_bytes(self) -> int:
        return int(self.view_history_mb * 2**20)

    @classmethod
    def flags(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_allowed_hosts(values: list[str] | None) -> tuple[str, ...]:
    """--allowed-hosts a,b --allowed-hosts c -> ("a", "b", "c")."""
    return tuple(h for v in values or () for h in v.split(",") if h.strip())


def host_allowed(host_header: str | None, allowed: tuple[str, ...]) -> bool:
    """May a request that says `Host: host_header` be answered?

    DNS rebinding needs a *name*: a page on evil.example makes the victim's browser resolve
    evil.example to 127.0.0.1 and read the answers as same-origin, and the browser still sends
    `Host: evil.example`. So an IP literal is fine (a class types the teacher's IP), a name must be
    localhost or one the server was told about. No Host at all (HTTP/1.0) is no browser's request.
    """
    if host_header is None:
        return True
    name = host_header.strip().lower()
    if name.startswith("["):  # [v6] or [v6]:port
        end = name.find("]")
        rest = name[end + 1 :]
        return end > 0 and _is_ip(name[1:end]) and (rest == "" or _is_port(rest[1:]) and rest[0] == ":")
    if name.count(":") == 1:  # name:port or v4:port
        name, port = name.split(":")
        if not _is_port(port):
            return False
    name = name.rstrip(".")
    if _is_ip(name):
        return True
    return name in LOCAL_NAMES or "*" in allowed or name in allowed


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def binds_every_interface(address: str) -> bool:
    """Is the address a socket was bound to the unspecified one (0.0.0.0, ::), however it was spelled?"""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_unspecified
    except ValueError:
        return False
