"""Certificates made at test time (the `cryptography` package): a CA, server and client
certificates it signs, a second CA nobody trusts, and an expired client certificate."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_NOW = dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA every party trusts
    server: Pair  # for 127.0.0.1 and localhost, signed by `ca`
    client: Pair  # signed by `ca`
    expired_client: Pair  # signed by `ca`, expired yesterday
    wrong_ca: Path  # a CA that signed nothing anyone uses
    wrong_client: Pair  # signed by `wrong_ca`
    token: Path  # a token file
    wrong_token: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn)).issuer_name(_name(cn))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(_NOW - dt.timedelta(days=1)).not_valid_after(_NOW + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], cn: str, server: bool,
          expired: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    start, end = ((_NOW - dt.timedelta(days=10), _NOW - dt.timedelta(days=1)) if expired
                  else (_NOW - dt.timedelta(days=1), _NOW + dt.timedelta(days=30)))
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn)).issuer_name(ca[0].subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(ca[1], hashes.SHA256()), key


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_pair(folder: Path, name: str, pair: tuple[x509.Certificate, ec.EllipticCurvePrivateKey]
                ) -> Pair:
    key = folder / f"{name}.key"
    key.write_bytes(pair[1].private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return Pair(_write_cert(folder / f"{name}.crt", pair[0]), key)


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, wrong = _ca("omnibus test CA"), _ca("someone else's CA")
    token, wrong_token = folder / "engine.token", folder / "wrong.token"
    token.write_text("s3cret-engine-token\n")
    wrong_token.write_text("not-the-token\n")
    return Pki(
        ca=_write_cert(folder / "ca.crt", ca[0]),
        server=_write_pair(folder, "server", _leaf(ca, "omnibus server", server=True)),
        client=_write_pair(folder, "client", _leaf(ca, "omnibus router", server=False)),
        expired_client=_write_pair(folder, "expired", _leaf(ca, "old router", False, expired=True)),
        wrong_ca=_write_cert(folder / "wrong-ca.crt", wrong[0]),
        wrong_client=_write_pair(folder, "wrong-client", _leaf(wrong, "impostor", server=False)),
        token=token,
        wrong_token=wrong_token,
    )
