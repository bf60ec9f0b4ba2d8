"""Mutual TLS for a closed swarm, with a certificate authority every key holder can rebuild.

No certificate is ever distributed: the swarm's CA private key is derived from the swarm key
(an EC P-256 scalar from ``SwarmKey.derive("tls-ca")``), so every member computes the same CA and
a stranger cannot. At start-up each node makes a fresh EC key pair of its own and a certificate for
it, signed by that CA and valid for a limited time; its server asks every caller for such a
certificate (``require_client_auth``) and its channels accept only servers that show one. The
connection is thereby encrypted and both ends proved key membership during the handshake, before
any call; the per-call MACs of ``grpc_auth.py`` still run inside it.

Peers are dialled by IP address, so certificates name the swarm rather than a host: each one
carries the DNS name :data:`SERVER_NAME` and channels check that name
(``grpc.ssl_target_name_override``). The CA certificate is rebuilt by each node (ECDSA signatures
are randomised, so the bytes differ) but has the same subject and public key everywhere, which is
all that chain verification looks at.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocol.auth.key import SwarmKey

SERVER_NAME: Final = "dtnode-swarm"
"""The DNS name in every member's certificate; channels check it instead of the dialled address."""

CERT_LIFETIME: Final = timedelta(days=30)
"""How long a node's certificate is valid; a node restarted later issues a new one."""

_P256_ORDER: Final = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_CA_SERIAL: Final = 1
_CA_EPOCH: Final = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)  # fixed: the CA certificate is the same everywhere
_CLOCK_SLACK: Final = timedelta(hours=1)  # a leaf is valid from a little before now: peers' clocks differ


@dataclass(frozen=True, repr=False)
class TlsIdentity:
    """PEM bytes of the swarm's CA certificate and of one node's own key and certificate."""

    root_pem: bytes
    key_pem: bytes
    cert_pem: bytes

    def __repr__(self) -> str:
        return "TlsIdentity(<private key hidden>)"


def _ca(key: SwarmKey) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    scalar = int.from_bytes(key.derive("tls-ca"), "big") % (_P256_ORDER - 1) + 1  # in [1, n-1]
    ca_key = ec.derive_private_key(scalar, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dtnode swarm CA {key.fingerprint}")])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(_CA_SERIAL)
        .not_valid_before(_CA_EPOCH)
        .not_valid_after(_CA_EPOCH + timedelta(days=365 * 100))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, certificate


def issue_identity(key: SwarmKey, *, lifetime: timedelta = CERT_LIFETIME) -> TlsIdentity:
    """A fresh key pair and a certificate for it from the swarm's CA (good as server and as client)."""
    ca_key, ca_certificate = _ca(key)
    node_key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
        .issuer_name(ca_certificate.subject)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SLACK)
        .not_valid_after(now + lifetime)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return TlsIdentity(
        root_pem=ca_certificate.public_bytes(serialization.Encoding.PEM),
        key_pem=node_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        cert_pem=certificate.public_bytes(serialization.Encoding.PEM),
    )


def server_credentials(identity: TlsIdentity) -> grpc.ServerCredentials:
    """Serve with our certificate and accept only callers with a certificate from the swarm's CA."""
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.cert_pem)], root_certificates=identity.root_pem, require_client_auth=True
    )


def channel_credentials(identity: TlsIdentity) -> grpc.ChannelCredentials:
    """Trust only servers with a certificate from the swarm's CA, and show ours when asked."""
    return grpc.ssl_channel_credentials(
        root_certificates=identity.root_pem, private_key=identity.key_pem, certificate_chain=identity.cert_pem
    )
