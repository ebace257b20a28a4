"""A throwaway self-signed TLS certificate for local HTTPS servers (the operator's webhook in tests).

Made with the ``cryptography`` package when it is installed, else with the ``openssl`` command;
``TLSUnavailable`` when neither is there (a test then skips).
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from pathlib import Path


class TLSUnavailable(RuntimeError):
    """Neither the cryptography package nor the openssl command is available."""


def self_signed(directory: str | Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
                days: int = 1) -> tuple[Path, Path]:
    """Write ``tls.crt`` and ``tls.key`` (PEM, as in a kubernetes.io/tls Secret) for ``hosts``
    (DNS names or IP addresses, all in the subjectAltName) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    try:
        _with_cryptography(cert, key, hosts, days)
    except ImportError:
        _with_openssl(cert, key, hosts, days)
    return cert, key


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _with_cryptography(cert: Path, key: Path, hosts: tuple[str, ...], days: int) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))


def _with_openssl(cert: Path, key: Path, hosts: tuple[str, ...], days: int) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TLSUnavailable("neither the cryptography package nor the openssl command is available")
    san = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", str(days), "-subj", f"/CN={hosts[0]}",
                    "-addext", f"subjectAltName={san}"],
                   check=True, capture_output=True)


__all__ = ["TLSUnavailable", "self_signed"]
