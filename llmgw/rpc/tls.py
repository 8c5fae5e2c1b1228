"""The cluster's certificate authority and mutual TLS for the RPC port.

Every llmgw process that speaks RPC holds a certificate issued by the cluster CA.
The certificate names the holder's *role* and *name*:

- ``control``: a control plane (server). It serves the RPC port and also dials peer
  control planes, so its certificate is good for both server and client use and
  carries subject alternative names (IP and DNS) for the addresses it serves.
- ``node``: an agent; the name is its node id. Client use only.
- ``admin``: an operator's ``llmgw ctl``; the name is the operator's. Client use only.

The role is written twice, and :func:`identity_of` refuses a certificate where the
two disagree: as the subject's ``OU`` (with ``CN`` = name), and as a SAN URI
``llmgw://<role>/<name>``.

What lives here:

- :class:`ClusterCA`: create/load the CA directory (``ca.pem`` + ``ca-key.pem``, key mode 0600)
  and :meth:`ClusterCA.issue` certificates;
- :func:`write_credentials` / :func:`read_credentials`: a holder's ``ca.pem``, ``cert.pem``,
  ``key.pem`` in one directory, with safe permissions and consistency checks;
- :func:`server_ssl_context` / :func:`client_ssl_context`: :class:`ssl.SSLContext` objects for
  ``trio.SSLStream`` (TLS >= 1.2, mutual: both sides verify the other against the cluster CA);
- :func:`peer_identity` and :func:`require_role`: who is on the other end of a handshaken
  stream, and the authorisation check on it;
- :func:`explain_tls_error`: an operator-facing sentence for a failed TLS connection.

Nothing here does network I/O. File I/O is blocking and small (a few KiB); callers in trio
code run it at start-up or through ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import datetime
import enum
import ipaddress
import os
import re
import secrets
import ssl
import tempfile
from pathlib import Path
from typing import Any, Collection, Iterable, Literal

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The file names and the name rule are plain values that llmgw.config shares.
from llmgw.credentials import CA_CERT_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE, check_name
from llmgw.files import atomic_write

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "CERT_FILE",
    "KEY_FILE",
    "ClusterCA",
    "Credentials",
    "Identity",
    "IssuedCert",
    "Role",
    "TLSFileError",
    "check_name",
    "client_ssl_context",
    "explain_tls_error",
    "identity_of",
    "peer_identity",
    "read_credentials",
    "require_role",
    "server_ssl_context",
    "write_credentials",
]

# --- tunables ---------------------------------------------------------------------------

#: The CA outlives many certificates; replacing it means re-issuing every certificate in
#: the cluster, so it is long-lived.
CA_VALIDITY_DAYS = 3650
#: Leaf certificates: long enough that a fleet does not surprise its operators with an
#: expiry outage (there is no automatic rotation yet), short enough that a stolen key does
#: not stay useful forever. ``llmgw ctl certs issue`` re-issues.
CERT_VALIDITY_DAYS = 730
#: Certificates start being valid a little in the past, so a node whose clock runs a few
#: minutes behind the control plane's can use a certificate issued just now.
CLOCK_SKEW_ALLOWANCE = datetime.timedelta(minutes=5)
#: TLS 1.2 is the oldest version still considered sound; 1.3 is negotiated when both ends
#: have it (they always do with llmgw on both ends).
MINIMUM_TLS_VERSION = ssl.TLSVersion.TLSv1_2

#: Private keys are readable by their owner only; directories holding them likewise.
_KEY_MODE = 0o600
_CERT_MODE = 0o644
_DIR_MODE = 0o700

#: URI scheme of the identity SAN: ``llmgw://<role>/<name>``.
IDENTITY_URI_SCHEME = "llmgw"

_DNS_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class Role(str, enum.Enum):
    """What a certificate's holder is allowed to be."""

    CONTROL = "control"  # a control plane: serves the RPC port, talks to peer control planes
    NODE = "node"  # an agent on a node
    ADMIN = "admin"  # an operator (llmgw ctl, or a program using llmgw.client)

    def __str__(self) -> str:
        return self.value


class TLSFileError(Exception):
    """A CA or credentials file is missing, unreadable, corrupt, too open, or does not match
    its partner file. The message names the file and says what to do."""


@attrs.frozen
class Identity:
    """Who a verified certificate says its holder is."""

    role: Role
    name: str
    #: The certificate's serial number as lower-case hex ("" where unknown); not part of
    #: equality: two certificates for one holder are the same identity.
    serial: str = attrs.field(default="", eq=False)

    def __str__(self) -> str:
        return f"{self.role.value} {self.name!r}"


@attrs.frozen
class IssuedCert:
    """A freshly issued certificate and its private key, both PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes = attrs.field(repr=False)


@attrs.frozen
class Credentials:
    """What one process needs for mutual TLS: the cluster CA certificate, and its own
    certificate and key (PEM bytes), plus the identity its certificate names."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = attrs.field(repr=False)
    identity: Identity


# --- names and identities ---------------------------------------------------------------


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        known = ", ".join(r.value for r in Role)
        raise ValueError(f"unknown role {role!r}: expected one of {known}") from None


def _identity_uri(role: Role, name: str) -> str:
    return f"{IDENTITY_URI_SCHEME}://{role.value}/{name}"


def identity_of(cert: x509.Certificate | bytes) -> Identity:
    """Return the :class:`Identity` a certificate (object, PEM or DER bytes) names.

    Does not verify the certificate (the TLS handshake did that for a peer's certificate).
    Raises :class:`PermissionError` if the certificate is not an llmgw identity certificate
    (no role, unknown role, or subject and SAN disagreeing).
    """
    if isinstance(cert, (bytes, bytearray)):
        cert = _load_cert_bytes(bytes(cert))
    subject = cert.subject
    roles = [a.value for a in subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    names = [a.value for a in subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ids = [u for u in uris.get_values_for_type(x509.UniformResourceIdentifier)
               if u.startswith(f"{IDENTITY_URI_SCHEME}://")]
    except x509.ExtensionNotFound:
        ids = []
    if len(roles) != 1 or len(names) != 1 or len(ids) != 1:
        raise PermissionError(
            f"certificate {subject.rfc4514_string()!r} is not an llmgw identity certificate "
            "(it needs exactly one OU=<role>, CN=<name> and llmgw://<role>/<name> SAN): "
            "issue one with `llmgw ctl certs issue`"
        )
    role_text, name = str(roles[0]), str(names[0])
    try:
        role = _role(role_text)
    except ValueError as exc:
        raise PermissionError(f"certificate names {exc}") from None
    if ids[0] != _identity_uri(role, name):
        raise PermissionError(
            f"certificate subject says {role.value} {name!r} but its SAN says {ids[0]!r}: "
            "refusing an inconsistent certificate"
        )
    return Identity(role, name, format(cert.serial_number, "x"))


def peer_identity(stream: Any) -> Identity:
    """Return the identity named by the verified certificate of the peer of ``stream``.

    ``stream`` is a handshaken ``trio.SSLStream``, ``ssl.SSLObject`` or ``ssl.SSLSocket``
    (anything with ``getpeercert(binary_form=True)``) whose context verified the peer:
    both contexts made here do (``CERT_REQUIRED``). Raises :class:`PermissionError` when the
    peer sent no certificate or one that is not an llmgw identity certificate;
    ``trio.NeedHandshakeError`` propagates if the handshake has not happened yet.
    """
    der = stream.getpeercert(binary_form=True)
    if not der:
        raise PermissionError("the peer presented no certificate: mutual TLS is required")
    return identity_of(der)


def require_role(
    identity: Identity, role: Role | str | Collection[Role | str], name: str | None = None
) -> None:
    """Check that ``identity`` may act as ``role`` (one role, or any of several) and, when
    ``name`` is given, that it is that holder. Returns ``None``.

    Raises :class:`PermissionError` with a message naming both sides, e.g.
    ``certificate of node 'a' cannot act as admin`` or
    ``certificate is for node 'a', but it tried to join as node 'b'``.
    """
    wanted = (
        {_role(role)} if isinstance(role, (str, Role)) else {_role(r) for r in role}
    )
    if identity.role not in wanted:
        wanted_text = " or ".join(sorted(r.value for r in wanted))
        raise PermissionError(
            f"certificate of {identity.role.value} {identity.name!r} cannot act as {wanted_text}"
        )
    if name is not None and name != identity.name:
        verb = "join" if identity.role is Role.NODE else "act"
        raise PermissionError(
            f"certificate is for {identity.role.value} {identity.name!r}, "
            f"but it tried to {verb} as {identity.role.value} {name!r}"
        )


# --- the CA -----------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def request_public_key(csr_pem: bytes) -> ec.EllipticCurvePublicKey:
    """Return the public key of the certificate signing request ``csr_pem``, for
    :meth:`ClusterCA.sign` (the private key stays with whoever made the request; the
    request's subject is not used: the caller decides the name). Raises
    :class:`ValueError` when it is not PEM, its signature does not verify (its maker does
    not hold the key), or the key is not elliptic-curve."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise ValueError(f"the certificate request is not valid PEM ({exc})") from None
    if not csr.is_signature_valid:
        raise ValueError("the certificate request's signature does not verify: it was not made with its key")
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ValueError("the certificate request must carry an elliptic-curve (P-256) key")
    return public_key


def request_name(csr_pem: bytes) -> str:
    """Return the common name the certificate signing request ``csr_pem`` asks for ("" for
    none): the name a node joining with a token that names none wants (its host name).
    Raises :class:`ValueError` when it is not PEM."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise ValueError(f"the certificate request is not valid PEM ({exc})") from None
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def check_sans(sans: Iterable[str]) -> None:
    """Return None when every one of ``sans`` is an IP address or DNS name a certificate may
    name; raise :class:`ValueError` naming the first that is not."""
    for san in sans:
        _parse_san(san)


def _parse_san(text: str) -> x509.GeneralName:
    """A SAN for an address a server is reached by: an IP address or a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if not text or len(text) > 253 or not all(_DNS_LABEL_RE.fullmatch(label) for label in labels):
        raise ValueError(f"invalid address for a certificate: {text!r} is neither an IP address "
                         "nor a DNS name")
    return x509.DNSName(text.rstrip(".").lower())


class ClusterCA:
    """The cluster's certificate authority: an EC P-256 key and a self-signed certificate.

    Create one with :meth:`create`, open an existing one with :meth:`load`; both return a
    :class:`ClusterCA` whose :meth:`issue` signs certificates for the cluster.
    """

    def __init__(self, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.certificate = certificate
        self._key = key

    # -- files --

    @classmethod
    def create(cls, directory: Path | str, *, days: int = CA_VALIDITY_DAYS) -> ClusterCA:
        """Create a new CA in ``directory`` (made, mode 0700, if missing) and return it.

        Writes ``ca.pem`` (0644) and ``ca-key.pem`` (0600). Raises :class:`TLSFileError` if a
        CA is already there (it is never overwritten: that would orphan every certificate
        issued by it) and :class:`OSError` if the directory cannot be written.
        """
        directory = Path(directory)
        cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
        for path in (cert_path, key_path):
            if path.exists():
                raise TLSFileError(
                    f"{path} already exists: refusing to overwrite a cluster CA "
                    "(every certificate it issued would stop working); use ClusterCA.load"
                )
        key = ec.generate_private_key(ec.SECP256R1())
        # A random tag in the CA's name tells two clusters' CAs apart in error messages and
        # in `openssl x509 -text` output.
        name = x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"llmgw cluster CA {secrets.token_hex(4)}"),
        ])
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW_ALLOWANCE)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        ca = cls(cert, key)
        _ensure_dir(directory)
        _write_file(key_path, ca._key_pem(), _KEY_MODE)
        _write_file(cert_path, ca.cert_pem, _CERT_MODE)
        return ca

    @classmethod
    def load(cls, directory: Path | str) -> ClusterCA:
        """Open the CA in ``directory`` and return it.

        Raises :class:`TLSFileError` when ``ca.pem`` or ``ca-key.pem`` is missing, is not PEM,
        when the key is readable by group or others, or when the key does not belong to the
        certificate.
        """
        directory = Path(directory)
        cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
        hint = f"no cluster CA in {directory}: create one with ClusterCA.create (`llmgw up` does)"
        cert = _load_cert_file(cert_path, missing_hint=hint)
        key = _load_key_file(key_path, missing_hint=hint)
        if not _key_matches(cert, key):
            raise TLSFileError(f"{key_path} is not the key of {cert_path}: "
                               "the CA directory holds files of two different CAs")
        if not _is_ca(cert):
            raise TLSFileError(f"{cert_path} is not a CA certificate")
        return cls(cert, key)

    def save(self, directory: Path | str) -> None:
        """Write this CA (``ca.pem`` 0644, ``ca-key.pem`` 0600) into ``directory`` (made,
        mode 0700, if missing): a control plane that joined keeps the cluster's CA, so any
        control plane can sign after a failover. Raises :class:`TLSFileError` if a different
        CA is there already, :class:`OSError` if the directory cannot be written."""
        directory = Path(directory)
        cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
        if cert_path.exists() and cert_path.read_bytes() != self.cert_pem:
            raise TLSFileError(f"{cert_path} holds another cluster's CA: refusing to overwrite it")
        _ensure_dir(directory)
        _write_file(key_path, self._key_pem(), _KEY_MODE)
        _write_file(cert_path, self.cert_pem, _CERT_MODE)

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> ClusterCA:
        """Return the CA made of ``cert_pem`` and ``key_pem``. Raises :class:`TLSFileError`
        when they are not PEM, do not belong together, or the certificate is not a CA's."""
        try:
            cert = _load_cert_bytes(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise TLSFileError(f"the cluster CA handed over is not PEM ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not _key_matches(cert, key) or not _is_ca(cert):
            raise TLSFileError("the cluster CA handed over is not a CA certificate with its key")
        return cls(cert, key)

    def key_pem(self) -> bytes:
        """The CA's private key, PEM: only ever handed to a control plane joining with a token."""
        return self._key_pem()

    # -- properties --

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM-encoded: what every member of the cluster trusts."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def fingerprint(self) -> str:
        """SHA-256 fingerprint of the CA certificate, as colon-separated hex."""
        return ":".join(f"{b:02X}" for b in self.certificate.fingerprint(hashes.SHA256()))

    def _key_pem(self) -> bytes:
        return _private_pem(self._key)

    # -- issuing --

    def issue(
        self,
        role: Role | str,
        name: str,
        *,
        sans: Iterable[str] = (),
        days: int = CERT_VALIDITY_DAYS,
        not_before: datetime.datetime | None = None,
    ) -> IssuedCert:
        """Issue a certificate for ``role`` holder ``name`` and return it with a new key.

        ``sans`` are the IP addresses and DNS names a control plane is reached by (clients
        check the address they dialled against them); refused for node and admin
        certificates, which are never servers. ``not_before`` defaults to now (less
        :data:`CLOCK_SKEW_ALLOWANCE`); validity ends ``days`` after it. Raises
        :class:`ValueError` for an unknown role, invalid name or SAN, or ``days < 1``.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        cert_pem = self.sign(role, name, key.public_key(), sans=sans, days=days, not_before=not_before)
        return IssuedCert(cert_pem=cert_pem, key_pem=_private_pem(key))

    def sign(
        self,
        role: Role | str,
        name: str,
        public_key: ec.EllipticCurvePublicKey,
        *,
        sans: Iterable[str] = (),
        days: int = CERT_VALIDITY_DAYS,
        not_before: datetime.datetime | None = None,
    ) -> bytes:
        """Return a PEM certificate for ``role`` holder ``name`` over ``public_key``; the
        arguments and errors are :meth:`issue`'s."""
        role = _role(role)
        check_name(name)
        if days < 1:
            raise ValueError(f"days must be at least 1, got {days}")
        san_names: list[x509.GeneralName] = [
            x509.UniformResourceIdentifier(_identity_uri(role, name))
        ]
        sans = list(sans)
        if sans and role is not Role.CONTROL:
            raise ValueError(f"only control plane certificates carry addresses; a {role.value} "
                             "certificate is never used by a server")
        for san in sans:
            general = _parse_san(san)
            if general not in san_names:
                san_names.append(general)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if role is Role.CONTROL:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        start = not_before if not_before is not None else _now() - CLOCK_SKEW_ALLOWANCE
        ca_ski = self.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=False,
                    crl_sign=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(san_names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                           critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski.value),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)


# --- credentials directories ------------------------------------------------------------


def write_credentials(directory: Path | str, ca_pem: bytes, issued: IssuedCert) -> Path:
    """Write ``ca.pem``, ``cert.pem`` and ``key.pem`` (0600) into ``directory`` (made, mode
    0700, if missing) and return the directory.

    Each file is replaced atomically, so a process reading them concurrently sees the old or
    the new file, never half of one. Raises :class:`OSError` if the directory is not
    writable.
    """
    directory = Path(directory)
    _ensure_dir(directory)
    _write_file(directory / KEY_FILE, issued.key_pem, _KEY_MODE)
    _write_file(directory / CERT_FILE, issued.cert_pem, _CERT_MODE)
    _write_file(directory / CA_CERT_FILE, ca_pem, _CERT_MODE)
    return directory


def read_credentials(
    ca: Path | str, cert: Path | str | None = None, key: Path | str | None = None
) -> Credentials:
    """Read and check a CA certificate, a certificate and its key; return :class:`Credentials`.

    Call it with a credentials directory alone (``read_credentials(dir)`` reads the three
    files :func:`write_credentials` wrote) or with three file paths (as in ``agent.yaml``'s
    ``tls`` section). Raises :class:`TLSFileError` when a file is missing or corrupt, the key
    is readable by group or others, the key does not belong to the certificate, the
    certificate was not issued by that CA, or it names no llmgw identity. An expired
    certificate is loaded (the peer refuses it with a clear message).
    """
    if cert is None and key is None:
        directory = Path(ca)
        ca_path, cert_path, key_path = (directory / CA_CERT_FILE, directory / CERT_FILE,
                                        directory / KEY_FILE)
    elif cert is not None and key is not None:
        ca_path, cert_path, key_path = Path(ca), Path(cert), Path(key)
    else:
        raise TypeError("read_credentials takes a directory, or the ca, cert and key paths")
    hint = "issue a certificate with `llmgw ctl certs issue` and copy it here"
    ca_cert = _load_cert_file(ca_path, missing_hint=hint)
    leaf = _load_cert_file(cert_path, missing_hint=hint)
    leaf_key = _load_key_file(key_path, missing_hint=hint)
    if not _key_matches(leaf, leaf_key):
        raise TLSFileError(f"{key_path} is not the key of {cert_path}: copy the matching pair")
    if not _issued_by(leaf, ca_cert):
        raise TLSFileError(
            f"{cert_path} was not issued by the CA in {ca_path} "
            f"({leaf.issuer.rfc4514_string()} vs {ca_cert.subject.rfc4514_string()}): "
            "copy this cluster's CA certificate, or re-issue with `llmgw ctl certs issue`"
        )
    try:
        identity = identity_of(leaf)
    except PermissionError as exc:
        raise TLSFileError(f"{cert_path}: {exc}") from None
    pem = serialization.Encoding.PEM
    return Credentials(
        ca_pem=ca_cert.public_bytes(pem),
        cert_pem=leaf.public_bytes(pem),
        key_pem=leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()),
        identity=identity,
    )


def _ensure_dir(directory: Path) -> None:
    directory.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)


def _write_file(path: Path, data: bytes, mode: int) -> None:
    atomic_write(path, data, mode)


def _read_file(path: Path, what: str, missing_hint: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TLSFileError(f"{what} {path} not found: {missing_hint}") from None
    except IsADirectoryError:
        raise TLSFileError(f"{what} {path} is a directory, not a file") from None
    except PermissionError:
        raise TLSFileError(f"{what} {path} is not readable by this user "
                           f"(uid {os.getuid()}): fix its owner") from None


def _load_cert_bytes(data: bytes) -> x509.Certificate:
    if data.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(data)
    return x509.load_der_x509_certificate(data)


def _load_cert_file(path: Path, *, missing_hint: str) -> x509.Certificate:
    data = _read_file(path, "certificate", missing_hint)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise TLSFileError(f"certificate {path} is not a PEM certificate ({exc}): "
                           "the file is corrupt or is something else") from None


def _load_key_file(path: Path, *, missing_hint: str) -> ec.EllipticCurvePrivateKey:
    data = _read_file(path, "private key", missing_hint)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise TLSFileError(f"private key {path} is readable by others (mode {mode:04o}): "
                           f"run `chmod 600 {path}`")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise TLSFileError(f"private key {path} is not an unencrypted PEM private key ({exc}): "
                           "the file is corrupt or is something else") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TLSFileError(f"private key {path} is a {type(key).__name__}, "
                           "not the EC key llmgw issues")
    return key


def _key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    return cert.public_key().public_bytes(der, raw) == key.public_key().public_bytes(der, raw)


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


# --- SSL contexts -----------------------------------------------------------------------


def _load_own_cert(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """``SSLContext.load_cert_chain`` reads files only: hand it the PEM through a private
    temporary directory (0700, key file 0600) that is removed before returning."""
    with tempfile.TemporaryDirectory(prefix="llmgw-tls-") as tmp:
        cert_path, key_path = Path(tmp) / CERT_FILE, Path(tmp) / KEY_FILE
        _write_file(cert_path, cert_pem, _KEY_MODE)
        _write_file(key_path, key_pem, _KEY_MODE)
        try:
            context.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as exc:
            raise TLSFileError(f"the certificate and key cannot be used ({exc}): "
                               "they are corrupt or do not belong together") from None


def _base_context(protocol: int, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = MINIMUM_TLS_VERSION
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_verify_locations(cadata=ca_pem.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError) as exc:
        raise TLSFileError(f"the cluster CA certificate is not valid PEM ({exc})") from None
    _load_own_cert(context, cert_pem, key_pem)
    return context


def server_ssl_context(
    ca_pem: bytes, cert_pem: bytes, key_pem: bytes, *, allow_anonymous: bool = False
) -> ssl.SSLContext:
    """Return a server-side context for the RPC port: presents ``cert_pem``/``key_pem`` and
    requires every client to present a certificate issued by the CA ``ca_pem`` (mutual TLS).

    With ``allow_anonymous`` a client may also present no certificate at all (one it does
    present must still verify): the caller must then give such a connection nothing but
    the way to join with a token. Use it with ``trio.SSLStream(stream, context,
    server_side=True)``. Who the client is, and what it may do, is then
    :func:`peer_identity` plus :func:`require_role`. Raises :class:`TLSFileError` for
    unusable PEM input.
    """
    context = _base_context(ssl.PROTOCOL_TLS_SERVER, ca_pem, cert_pem, key_pem)
    if allow_anonymous:
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def anonymous_client_context() -> ssl.SSLContext:
    """Return a client context with no certificate of its own that accepts any server
    certificate: only for joining with a token, where the caller checks the server with
    :func:`check_pinned_server` before sending anything secret."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = MINIMUM_TLS_VERSION
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def ca_sha256(ca_pem: bytes) -> str:
    """Return the SHA-256 of the CA certificate ``ca_pem`` (DER) as lower-case hex, the pin
    a join token carries. Raises :class:`ValueError` for input that is not a PEM certificate."""
    return _load_cert_bytes(ca_pem).fingerprint(hashes.SHA256()).hex()


def check_pinned_server(server_der: bytes | None, ca_pem: bytes, pinned_sha256: str) -> None:
    """Check that ``ca_pem`` is the CA pinned by ``pinned_sha256`` and that the server's
    certificate ``server_der`` (what the TLS handshake presented) is a control plane's,
    issued by it. The handshake already proved the server holds that certificate's key.

    Returns None. Raises :class:`PermissionError` saying what did not match: the caller is
    talking to something other than the cluster the token came from.
    """
    if ca_sha256(ca_pem) != pinned_sha256.lower():
        raise PermissionError("the server's cluster CA is not the one the join token names: this is another "
                              "cluster, or something between you and it answered; check the address")
    if not server_der:
        raise PermissionError("the server presented no certificate")
    server = x509.load_der_x509_certificate(server_der)
    if not _issued_by(server, _load_cert_bytes(ca_pem)):
        raise PermissionError("the server's certificate was not issued by the cluster CA the join token names")
    if identity_of(server).role is not Role.CONTROL:
        raise PermissionError("the server's certificate is not a control plane's")


def certificate_request(key_pem: bytes, name: str) -> bytes:
    """Return a PEM certificate signing request for ``name`` signed with the private key
    ``key_pem`` (it proves the key's holder asks; only its public key leaves the machine)."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("the key must be an elliptic-curve (P-256) key")
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM)


def new_private_key() -> bytes:
    """Return a new P-256 private key, PEM (PKCS#8, unencrypted): what :meth:`ClusterCA.issue` makes."""
    return _private_pem(ec.generate_private_key(ec.SECP256R1()))


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def client_ssl_context(
    ca_pem: bytes, cert_pem: bytes, key_pem: bytes, *, check_hostname: bool = True
) -> ssl.SSLContext:
    """Return a client-side context: presents ``cert_pem``/``key_pem`` and verifies the
    server's certificate against the CA ``ca_pem``.

    With ``check_hostname`` (the default) the address passed as ``server_hostname`` to
    ``trio.SSLStream`` must be one of the IP/DNS SANs in the server's certificate (the
    subject's CN is never used as a host name). Turn it off only when the caller checks
    the server's identity itself: the certificate still has to come from the cluster CA and
    be a control plane's (its extended key usage must allow server use). Raises
    :class:`TLSFileError` for unusable PEM input.
    """
    context = _base_context(ssl.PROTOCOL_TLS_CLIENT, ca_pem, cert_pem, key_pem)
    context.hostname_checks_common_name = False
    context.check_hostname = check_hostname
    return context


# --- explaining failures ----------------------------------------------------------------

Side = Literal["client", "server"]

_REISSUE = "re-issue the certificate with `llmgw ctl certs issue`"
_COPY_CA = "copy this cluster's CA certificate (ca.pem) to this machine"

#: OpenSSL verify codes (X509_V_ERR_*) that mean "this certificate chains to a CA we do
#: not trust".
_UNKNOWN_ISSUER_CODES = {
    2,  # unable to get issuer certificate
    18,  # self-signed certificate
    19,  # self-signed certificate in certificate chain
    20,  # unable to get local issuer certificate
    21,  # unable to verify the first certificate
    7,  # certificate signature failure
}
_EXPIRED_CODE = 10
_NOT_YET_VALID_CODE = 9
_PURPOSE_CODE = 26  # unsupported certificate purpose
_HOSTNAME_CODES = {62, 64}  # hostname mismatch, IP address mismatch

#: TLS alerts a peer sends when it refuses *our* certificate (OpenSSL's reason names).
_ALERT_REFUSED = {
    "TLSV1_ALERT_UNKNOWN_CA": "not issued by the cluster's CA",
    "SSLV3_ALERT_BAD_CERTIFICATE": "a bad certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the certificate has expired (or is not valid yet)",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "a certificate not meant for this use",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "a certificate it could not accept",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "a revoked certificate",
    "TLSV1_ALERT_DECRYPT_ERROR": "a certificate whose key does not match",
}


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _ssl_reason(err: ssl.SSLError) -> str:
    reason = getattr(err, "reason", None)
    if reason:
        return str(reason)
    return str(err)


def explain_tls_error(exc: BaseException, *, side: Side, peer: str | None = None) -> str:
    """Return one sentence for an operator saying why a TLS connection failed and what to do.

    ``exc`` is what the handshake, or the first read or write after it, raised: an
    ``ssl.SSLError``, a ``trio.BrokenResourceError`` wrapping one (trio chains the cause), or a
    connection error. ``side`` is this end's role in the TLS connection ("client" dialled,
    "server" accepted); ``peer`` (e.g. ``"10.0.0.5:7070"``) is put in the message when given.

    With TLS 1.3 a client whose certificate the server refuses completes its own handshake and
    only fails on its first read, with the server's alert (``unknown ca``, ``certificate
    required``, ...) or with an unexpected EOF: those are explained as "the server refused
    this machine's certificate" too. Never raises.
    """
    if side not in ("client", "server"):
        raise ValueError(f"side must be 'client' or 'server', got {side!r}")
    other = "server" if side == "client" else "client"
    where = f" ({other} {peer})" if peer else ""
    chain = _chain(exc)
    verify = next((e for e in chain if isinstance(e, ssl.SSLCertVerificationError)), None)
    if verify is not None:
        return _explain_verify(verify, side, where)
    ssl_err = next((e for e in chain if isinstance(e, ssl.SSLError)), None)
    if ssl_err is not None:
        return _explain_ssl(ssl_err, side, where)
    if any(isinstance(e, (ConnectionResetError, BrokenPipeError)) for e in chain) or (
        type(exc).__name__ == "BrokenResourceError" and len(chain) == 1
    ):
        return _closed(side, where, f"{type(chain[-1]).__name__}: {chain[-1]}")
    return f"TLS connection failed{where}: {type(exc).__name__}: {exc}"


def _closed(side: Side, where: str, detail: str) -> str:
    if side == "client":
        return (
            f"the server closed the connection during or right after the TLS handshake{where} "
            f"({detail}): this is how a server refuses a client certificate; check that this "
            f"machine's certificate was issued by the cluster's CA and has not expired "
            f"(the server's log says why), or {_REISSUE}"
        )
    return (
        f"the client closed the connection during the TLS handshake{where} ({detail}): it "
        "probably refused this server's certificate (its log says why)"
    )


def _explain_verify(err: ssl.SSLCertVerificationError, side: Side, where: str) -> str:
    code = getattr(err, "verify_code", None)
    detail = f"certificate verify failed: {getattr(err, 'verify_message', None) or err}"
    if side == "server":
        if code in _UNKNOWN_ISSUER_CODES:
            why = "not issued by this cluster's CA"
            todo = "give the client a certificate from `llmgw ctl certs issue`"
        elif code == _EXPIRED_CODE:
            why, todo = "it has expired", _REISSUE
        elif code == _NOT_YET_VALID_CODE:
            why, todo = "it is not valid yet", "check the clocks of both machines"
        elif code == _PURPOSE_CODE:
            why, todo = "it is not a client certificate", _REISSUE
        else:
            why, todo = "it failed verification", _REISSUE
        return f"client certificate refused{where}: {why} ({detail}): {todo}"
    if code in _UNKNOWN_ISSUER_CODES:
        return (
            f"the peer's certificate was not issued by this cluster's CA{where} ({detail}): "
            f"{_COPY_CA}, or {_REISSUE}"
        )
    if code == _EXPIRED_CODE:
        return f"the server's certificate has expired{where} ({detail}): {_REISSUE}"
    if code == _NOT_YET_VALID_CODE:
        return (f"the server's certificate is not valid yet{where} ({detail}): "
                "check the clocks of both machines")
    if code in _HOSTNAME_CODES:
        return (
            f"the server's certificate does not name the address this machine dialled{where} "
            f"({detail}): dial an address listed in the server's advertise_hosts, or add this "
            f"one there and {_REISSUE}"
        )
    if code == _PURPOSE_CODE:
        return (f"the server's certificate is not a control plane's{where} ({detail}): "
                "the address is not an llmgw control plane's RPC port")
    return f"the server's certificate was refused{where} ({detail}): {_REISSUE}"


def _explain_ssl(err: ssl.SSLError, side: Side, where: str) -> str:
    reason = _ssl_reason(err)
    detail = str(err)
    if reason in _ALERT_REFUSED:
        why = _ALERT_REFUSED[reason]
        if side == "client":
            todo = _REISSUE if reason != "TLSV1_ALERT_UNKNOWN_CA" else (
                f"this machine's certificate is not from the cluster's CA: {_REISSUE}")
            return (f"the server refused this machine's certificate{where}: {why} "
                    f"({detail}): {todo}")
        return (f"the client refused this server's certificate{where}: {why} ({detail}): "
                f"copy this cluster's CA certificate (ca.pem) to the client, or {_REISSUE}")
    if reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        if side == "client":
            return (f"the server requires a client certificate and this machine sent none"
                    f"{where} ({detail}): configure tls.cert and tls.key")
        return (f"client certificate refused{where}: the client sent none ({detail}): the RPC "
                "port requires mutual TLS; give the client a certificate from "
                "`llmgw ctl certs issue`")
    if reason == "HTTP_REQUEST":
        return (f"the client sent plain HTTP to the RPC port{where} ({detail}): "
                "use the HTTP port for the gateway and the API")
    if reason in ("WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE",
                  "PACKET_LENGTH_TOO_LONG"):
        return (f"the {'server' if side == 'client' else 'client'} is not speaking TLS{where} "
                f"({detail}): check that the address is an llmgw RPC port (not the HTTP port)")
    # Python 3.11.2 (Debian 12's) reports a peer that closed mid-handshake as a TLS close
    # (SSLZeroReturnError), later versions as an unexpected EOF: the same event.
    if isinstance(err, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) or reason == "UNEXPECTED_EOF_WHILE_READING":
        return _closed(side, where, detail)
    if reason in ("UNSUPPORTED_PROTOCOL", "TLSV1_ALERT_PROTOCOL_VERSION", "NO_PROTOCOLS_AVAILABLE"):
        return (f"the two ends share no TLS version{where} ({detail}): llmgw needs TLS 1.2 "
                "or newer on both ends")
    return f"TLS failed{where}: {detail}"
