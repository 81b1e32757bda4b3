"""Tenants: who a bearer token belongs to, whether it may administer the service, and the
cross-request state partition a request of theirs may share.

The service keeps state across requests on purpose (the suffix drafter's tree of previous
outputs, warm KV-cache prefixes), and every response reports speculation counters and
arrives after a measurable time. Shared between clients, that state tells one client what
another sent (its counters and timing change once the other's text is cached). So every
cross-request cache is *partitioned*: a request reads and feeds only the partition of its
(tenant, ``cache_salt``), as vLLM partitions its prefix cache by ``cache_salt``. Without
tokens and salts every request is in the one shared partition ``""``, as before.

Tokens come from ``--auth-token`` (repeatable: tenants ``key1``, ``key2``, ... in order),
``--admin-token`` (tenant ``admin``) and ``--auth-tokens-file``: one token per line,
``<tenant> <token> [admin]``, ``#`` comments (at a line's start or after whitespace; a ``#``
inside a token is part of it); a tenant may have several lines (tokens being rotated). The
file is re-read when it changes (checked at most once a second); a file that no longer
parses keeps the tokens in force and logs why.
Status, Scale and ``/metrics`` need an admin token: ``--admin-token``, a file line marked
``admin``, or the only ``--auth-token`` when there is one token and no admin named.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: A tenant's name: it labels metrics and logs, so it is short and plain.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: The longest ``cache_salt`` accepted, characters (vLLM suggests 43: 256 random bits, base64).
MAX_CACHE_SALT_CHARS = 1024
#: Seconds between two checks of the tokens file for changes.
RELOAD_CHECK_S = 1.0
#: A comment in a tokens file: ``#`` at the start of a line or after whitespace, to its end.
_COMMENT = re.compile(r"(^|\s)#.*$")
#: Where the HTTP API's guard (`coordinator.front.http_server.Guard`) leaves the caller's `Tenant`
#: in the ASGI scope.
TENANT_SCOPE_KEY = "specd.tenant"


@dataclass(frozen=True)
class Tenant:
    """A token's owner: ``name`` (labels its metrics) and whether it may administer."""

    name: str
    admin: bool = False


def partition_of(tenant: str, cache_salt: str | None) -> str:
    """The cross-request state partition of a request of ``tenant`` with ``cache_salt``: ``""``
    (the shared default) for neither, else an opaque 32-hex-digit digest of both (so a salt
    never travels to the workers nor appears in their logs, and no (tenant, salt) pair can
    spell another's).

    Raises:
        ValueError: ``cache_salt`` empty or over `MAX_CACHE_SALT_CHARS` characters.
    """
    check_cache_salt(cache_salt)
    if not tenant and cache_salt is None:
        return ""
    key = json.dumps([tenant, cache_salt], ensure_ascii=False).encode()
    return hashlib.sha256(key).hexdigest()[:32]


def check_cache_salt(cache_salt: str | None) -> None:
    """Raises ValueError naming ``cache_salt`` unless it is None or a non-empty string of at
    most `MAX_CACHE_SALT_CHARS` characters (vLLM's rule, plus a cap)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt: must be a non-empty string when given")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt: {len(cache_salt)} characters is over the "
                         f"{MAX_CACHE_SALT_CHARS} allowed")


def parse_tokens_file(text: str, source: str = "tokens file") -> dict[str, Tenant]:
    """``{token: Tenant}`` from a tokens file's text (see the module docstring).

    Raises:
        ValueError: naming the line: not ``<tenant> <token> [admin]``, a bad tenant name, a
            token given twice, or no token at all.
    """
    tokens: dict[str, Tenant] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        # A comment starts a line or follows whitespace: a '#' inside a token is the token's.
        line = _COMMENT.sub("", raw).strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ValueError(f"{source} line {number}: expected '<tenant> <token> [admin]'")
        if len(parts) == 3 and parts[2] != "admin":
            raise ValueError(f"{source} line {number}: the third word may only be 'admin', "
                             f"got {parts[2][:40]!r}")
        name, token = parts[0], parts[1]
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{source} line {number}: tenant name {name!r} must be 1-64 of "
                             "letters, digits, '_', '.', '-' (starting with a letter or digit)")
        if token in tokens:
            raise ValueError(f"{source} line {number}: this token is already given to tenant "
                             f"{tokens[token].name!r}")
        tokens[token] = Tenant(name, admin=len(parts) == 3)
    if not tokens:
        raise ValueError(f"{source}: no tokens")
    return tokens


class Tenants:
    """The token table both APIs authenticate with (thread-safe: the HTTP and gRPC servers
    share one).

    Args:
        auth_tokens: ``--auth-token`` values: tenants ``key1``, ``key2``, ... in order; a
            single one with no other admin configured is also the admin (one-tenant
            servers keep working as before).
        admin_token: ``--admin-token``: the ``admin`` tenant.
        tokens_file: ``--auth-tokens-file`` path (re-read when it changes).

    Raises:
        ValueError: an empty token, the same token twice, or a tokens file that cannot be
            read or parsed (naming the line).
    """

    def __init__(self, auth_tokens: Sequence[str] = (), admin_token: str | None = None,
                 tokens_file: str | None = None):
        self._fixed: dict[str, Tenant] = {}
        for i, token in enumerate(auth_tokens, 1):
            self._add_fixed(token, Tenant(f"key{i}"), "--auth-token")
        if admin_token is not None:
            self._add_fixed(admin_token, Tenant("admin", admin=True), "--admin-token")
        self.tokens_file = tokens_file
        self._file: dict[str, Tenant] = {}
        self._file_stamp: tuple | None = None
        self._checked_at = 0.0
        self._lock = threading.Lock()
        if tokens_file is not None:
            self._file = self._read_file()
        if (len(auth_tokens) == 1 and admin_token is None
                and not any(t.admin for t in self._file.values())):
            token = auth_tokens[0]
            self._fixed[token] = Tenant("key1", admin=True)
        for token in self._file:
            if token in self._fixed:
                raise ValueError(f"{tokens_file}: a token of tenant {self._file[token].name!r} "
                                 "is also given on the command line")

    def _add_fixed(self, token: str, tenant: Tenant, flag: str) -> None:
        if not isinstance(token, str) or not token.strip():
            raise ValueError(f"{flag}: the token must be non-empty")
        if token != token.strip():
            raise ValueError(f"{flag}: the token must not start or end with whitespace")
        if token in self._fixed:
            raise ValueError(f"{flag}: this token is already given to tenant "
                             f"{self._fixed[token].name!r}")
        self._fixed[token] = tenant

    def _stamp(self) -> tuple:
        st = os.stat(self.tokens_file)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read_file(self) -> dict[str, Tenant]:
        try:
            stamp = self._stamp()
            with open(self.tokens_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"--auth-tokens-file: cannot read {self.tokens_file}: "
                             f"{exc.strerror}") from None
        table = parse_tokens_file(text, self.tokens_file)
        self._file_stamp = stamp
        return table

    def reload_if_changed(self, now: float | None = None) -> bool:
        """Re-reads the tokens file if it changed since it was read (checked at most once
        per `RELOAD_CHECK_S` unless ``now`` is given); returns whether the table changed. A
        file that no longer reads or parses keeps the old tokens (logged)."""
        if self.tokens_file is None:
            return False
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._checked_at < RELOAD_CHECK_S:
                return False
            self._checked_at = now
            try:
                if self._stamp() == self._file_stamp:
                    return False
                table = self._read_file()
            except (OSError, ValueError) as exc:
                log.error("tokens file not reloaded, the previous tokens stay in force: %s",
                          exc)
                return False
            clash = [t.name for tok, t in table.items() if tok in self._fixed]
            if clash:
                log.error("tokens file not reloaded: tenant %s's token is also given on the "
                          "command line", clash[0])
                return False
            self._file = table
            log.info("tokens file reloaded: %d tenants", len(table))
            return True

    @property
    def enabled(self) -> bool:
        """Whether any token is configured (else the APIs are open, one anonymous tenant)."""
        return bool(self._fixed) or self.tokens_file is not None

    def names(self) -> list[str]:
        """Every tenant's name, sorted, each once."""
        return sorted({t.name for t in (*self._fixed.values(), *self._file.values())})

    def lookup(self, token: str) -> Tenant | None:
        """The tenant ``token`` belongs to, or None. Every configured token is compared in
        constant time (no early exit), so the time does not tell how close a guess came."""
        self.reload_if_changed()
        given = token.encode()
        found = None
        for known, tenant in (*self._fixed.items(), *self._file.items()):
            if hmac.compare_digest(given, known.encode()) and found is None:
                found = tenant
        return found

    def from_authorization(self, value: str) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <token>`` value (the scheme name is
        case-insensitive, RFC 6750), or None."""
        scheme, _, given = value.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        return self.lookup(given.strip())


#: The tenant of every request on a server without tokens.
ANONYMOUS = Tenant("", admin=True)

__all__ = [
    "ANONYMOUS",
    "MAX_CACHE_SALT_CHARS",
    "TENANT_SCOPE_KEY",
    "Tenant",
    "Tenants",
    "check_cache_salt",
    "parse_tokens_file",
    "partition_of",
]
