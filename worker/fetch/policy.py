"""Which addresses a `url` job may reach, and what of a URL may be written down.

A job's URL is input from a producer the worker does not control: without a check it could
make the worker read cloud metadata (169.254.169.254), an admin port on loopback, or a
service on the private network, and hand the bytes to whoever reads the results. So every
address a connection is about to use is checked here, after DNS resolution (a public name
may resolve to a private address) and again for every redirect hop.

Refused unless GPUFEED_URL_ALLOW names the host or a CIDR holding the address: loopback,
private, link-local, shared (100.64.0.0/10), reserved, unspecified and multicast addresses,
and the IPv6 forms that carry one of them (IPv4-mapped, -compatible and -translated, 6to4,
NAT64), judged by the IPv4 address they carry; local-use NAT64 (64:ff9b:1::/48) and
site-local (fec0::/10) addresses too. GPUFEED_URL_DENY refuses more, and wins over
the allow list.

Only stdlib here: the configuration validates the lists without the HTTP client installed.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_HOST_RE = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?$")
# IPv6 forms that carry an IPv4 address in their last 32 bits, and so reach (or name) it:
# NAT64's well-known prefix (RFC 6052: 64:ff9b::7f00:1 is loopback), IPv4-translated
# (RFC 2765) and IPv4-compatible (::a.b.c.d, deprecated) addresses. IPv4-mapped ones are
# `ipv4_mapped`, 6to4 (2002::/16, the address in bits 16-47) `sixtofour`.
_LAST_32 = tuple(ipaddress.IPv6Network(n) for n in ("64:ff9b::/96", "::ffff:0:0:0/96", "::/96"))
# No IPv4 address to judge them by, and never public: local-use NAT64 (RFC 8215; where its
# IPv4 address sits depends on the operator's prefix length) and deprecated site-local.
_NOT_PUBLIC_V6 = {
    ipaddress.IPv6Network("64:ff9b:1::/48"): "reserved",
    ipaddress.IPv6Network("fec0::/10"): "private",
}


@dataclass(frozen=True)
class HostList:
    """Host names (exact, or `*.suffix` for every name below it) and networks."""

    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = ()

    def has_name(self, host: str) -> bool:
        host = _norm_host(host)
        return host in self.names or any(host.endswith(s) for s in self.suffixes)

    def has_address(self, ip: IPAddress) -> bool:
        return any(ip.version == n.version and ip in n for n in self.networks)

    def __bool__(self) -> bool:
        return bool(self.names or self.suffixes or self.networks)


def parse_host_list(raw: str) -> HostList:
    """`images.internal, *.cdn.example, 10.0.0.0/8, 127.0.0.1` -> HostList; ValueError names
    the entry that is neither a host name nor an address or CIDR."""
    names: set[str] = set()
    suffixes: list[str] = []
    networks: list[IPNetwork] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            continue
        except ValueError:
            pass
        host = _norm_host(entry)
        if not _HOST_RE.match(host):
            raise ValueError(f"{entry!r} is neither a host name nor an address or CIDR")
        if host.startswith("*."):
            suffixes.append(host[1:])
        else:
            names.add(host)
    return HostList(frozenset(names), tuple(suffixes), tuple(networks))


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _norm_host(host: str) -> str:
    return host.strip().lower().rstrip(".")


def address_class(ip: IPAddress) -> str:
    """`public`, or the kind of address that is refused by default."""
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        for network, kind in _NOT_PUBLIC_V6.items():
            if ip in network:
                return kind
    ip = _embedded_v4(ip)
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        # 100.64.0.0/10 (carrier-grade NAT), 240.0.0.0/4 and other reserved ranges.
        return "reserved"
    return "public"


def _embedded_v4(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one carries (see _LAST_32), else `ip` itself."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if any(ip in network for network in _LAST_32):
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


class AddressPolicy:
    """The check every connection's address goes through (see the module docstring)."""

    def __init__(self, allow: HostList, deny: HostList) -> None:
        self.allow = allow
        self.deny = deny

    @classmethod
    def from_settings(cls, allow: str, deny: str) -> AddressPolicy:
        return cls(parse_host_list(allow), parse_host_list(deny))

    def refuse_host(self, host: str) -> str | None:
        """Why the host name alone is refused (GPUFEED_URL_DENY), before any lookup."""
        if self.deny.has_name(host):
            return f"{_norm_host(host)} is in GPUFEED_URL_DENY"
        return None

    def refuse_address(self, host: str, ip: IPAddress) -> str | None:
        """Why connecting to `ip` (which `host` resolved to) is refused; None: allowed."""
        plain = _embedded_v4(ip)
        if self.deny.has_name(host) or self.deny.has_address(ip) or self.deny.has_address(plain):
            return f"{ip} is in GPUFEED_URL_DENY"
        kind = address_class(ip)
        if kind == "public":
            return None
        if self.allow.has_name(host) or self.allow.has_address(ip) or self.allow.has_address(plain):
            return None
        # A name's address is not echoed: the job would learn the private network's DNS.
        where = f"{ip}, a" if _is_literal(host) else f"{_norm_host(host)} resolves to a"
        return (
            f"{where} {kind} address; the worker fetches only from public addresses "
            "unless GPUFEED_URL_ALLOW names the host or its network"
        )

    def host_class(self, ip: IPAddress) -> str:
        """For metrics: `public`, or `allowed` for a non-public address let through."""
        return "public" if address_class(ip) == "public" else "allowed"


def loggable_url(url: str) -> str:
    """`url` without its query string, fragment and user-info: what logs and error messages
    may show (a presigned URL's signature is in its query; a password in its user-info)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        port = ""
    tail = "?..." if parts.query else ""
    return f"{parts.scheme}://{host}{port}{parts.path}{tail}"
