"""Who may reach an endpoint Kitchen serves: one rule for the launcher's gRPC port
(launcher/settings.py) and a serve job's HTTP API (protos/validation_kinds.py).

An endpoint on the loopback interface is this machine's business. Off it, two gaps must each be
closed or explicitly allowed (a trusted network): without TLS, credentials and payloads travel
in clear (PLAINTEXT); without credentials, anyone who reaches the port can use it
(UNAUTHENTICATED). Each caller words the fix in its own fields.

Secrets are read from a file (or, for a serve job, an environment variable) named in the
config, never written in it: a config is shown, logged and stored in the launcher's database.
"""

import enum
import ipaddress
import os

from protos.config_yaml import ConfigError

MIN_SECRET_CHARS = 16  # a token someone could guess is no token


class Gap(enum.Enum):
    PLAINTEXT = "plaintext"  # off-loopback without TLS
    UNAUTHENTICATED = "unauthenticated"  # off-loopback without credentials


def is_loopback_host(host: str) -> bool:
    """Whether `host` is this machine only (127.0.0.0/8, ::1, localhost); "" and 0.0.0.0 are
    every interface, a host name may resolve anywhere."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "" (every interface)
        return False


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT listens on this machine only."""
    return is_loopback_host(address.rpartition(":")[0])


def exposure_gaps(
    host: str, *, tls: bool, auth: bool, allow_plaintext: bool, allow_unauthenticated: bool
) -> list[Gap]:
    """What an endpoint on `host` leaves open that its config did not allow (none: fine)."""
    if is_loopback_host(host):
        return []
    gaps = []
    if not tls and not allow_plaintext:
        gaps.append(Gap.PLAINTEXT)
    if not auth and not allow_unauthenticated:
        gaps.append(Gap.UNAUTHENTICATED)
    return gaps


def read_secret_file(path: str, field: str) -> str:
    """The secret in the file at `path` (surrounding whitespace dropped); a ConfigError naming
    `field` when it cannot be read or is too short to be one."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as err:
        raise ConfigError(field, f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(field, f"{path} is not UTF-8 text") from None
    return _long_enough(secret, field, "holds")


def read_secret_env(name: str, field: str) -> str:
    """The secret in environment variable `name`; a ConfigError naming `field` when unset or
    too short."""
    if name not in os.environ:
        raise ConfigError(field, f"environment variable {name} is not set")
    return _long_enough(os.environ[name].strip(), field, f"${name} holds")


def _long_enough(secret: str, field: str, holder: str) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(field, f"{holder} fewer than {MIN_SECRET_CHARS} characters")
    return secret
