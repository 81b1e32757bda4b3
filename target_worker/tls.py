"""TLS for the per-step channels between nodes: a self-signed certificate per worker.

Each target replica and drafter worker generates its own key pair and a certificate for the
name `CHANNEL_HOSTNAME` when it opens its channel (`generate_certificate`); only the
certificate travels (through Ray) to the coordinator, which trusts that certificate alone for
that worker (`client_context`; gRPC: ``root_certificates`` plus
``grpc.ssl_target_name_override``). Private keys never leave the process that uses them, so a
machine that reads the network (Ray's own traffic included) cannot decrypt the channels, and
one in the middle has neither the key to terminate TLS nor the secret to pass the channel's
own handshake. TLS 1.3 only.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile

__all__ = ["CHANNEL_HOSTNAME", "client_context", "generate_certificate", "server_context"]

#: The name every channel certificate is issued to and checked against (node IPs vary).
CHANNEL_HOSTNAME = "specd-channel"


def generate_certificate(days: int = 365) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a self-signed certificate for `CHANNEL_HOSTNAME`, valid
    for ``days`` days: ``(certificate PEM, private key PEM)``.

    Raises:
        ImportError: the ``cryptography`` package is missing.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CHANNEL_HOSTNAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CHANNEL_HOSTNAME)]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM,
                              serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A TLS 1.3 server context presenting ``cert_pem`` with ``key_pem``.

    Raises:
        ssl.SSLError: a certificate or key that does not load or match.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # The ssl module loads key material from files only: a private temporary one, removed
    # at once.
    fd, path = tempfile.mkstemp(prefix="specd-channel-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem + b"\n" + key_pem)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
    return context


def client_context(cert_pem: bytes) -> ssl.SSLContext:
    """A TLS 1.3 client context that trusts ``cert_pem`` alone and checks the peer's name
    (connect with ``server_hostname=CHANNEL_HOSTNAME``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=cert_pem.decode())
    return context
