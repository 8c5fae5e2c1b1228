"""Unit tests for llmgw.rpc.tls: the cluster CA, issued certificates, credential files,
SSL context settings, authorisation checks and error explanations (no network)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.rpc import tls
from llmgw.rpc.tls import (
    ClusterCA,
    Identity,
    Role,
    TLSFileError,
    client_ssl_context,
    explain_tls_error,
    identity_of,
    read_credentials,
    require_role,
    server_ssl_context,
    write_credentials,
)

UTC = datetime.timezone.utc


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> ClusterCA:
    return ClusterCA.create(tmp_path_factory.mktemp("pki") / "ca")


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> ClusterCA:
    return ClusterCA.create(tmp_path_factory.mktemp("pki") / "other-ca")


# --- the CA -------------------------------------------------------------------------------


def test_create_writes_files_with_safe_permissions_and_load_round_trips(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "ca"
    created = ClusterCA.create(directory)
    assert mode(directory) == 0o700
    assert mode(directory / tls.CA_KEY_FILE) == 0o600
    assert mode(directory / tls.CA_CERT_FILE) == 0o644
    loaded = ClusterCA.load(directory)
    assert loaded.fingerprint == created.fingerprint
    assert loaded.cert_pem == created.cert_pem
    cert = x509.load_pem_x509_certificate(loaded.cert_pem)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # what the loaded CA issues verifies against the created CA's certificate
    leaf = x509.load_pem_x509_certificate(loaded.issue("node", "n1").cert_pem)
    leaf.verify_directly_issued_by(created.certificate)


def test_two_cas_are_distinguishable(ca: ClusterCA, other_ca: ClusterCA) -> None:
    assert ca.fingerprint != other_ca.fingerprint
    assert ca.certificate.subject != other_ca.certificate.subject


def test_create_refuses_to_overwrite(tmp_path: Path) -> None:
    first = ClusterCA.create(tmp_path)
    with pytest.raises(TLSFileError, match="refusing to overwrite a cluster CA"):
        ClusterCA.create(tmp_path)
    assert ClusterCA.load(tmp_path).fingerprint == first.fingerprint


def test_load_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TLSFileError) as info:
        ClusterCA.load(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / tls.CA_CERT_FILE) in str(info.value)
    assert "not found" in str(info.value)


def test_load_missing_key(tmp_path: Path) -> None:
    ClusterCA.create(tmp_path)
    (tmp_path / tls.CA_KEY_FILE).unlink()
    with pytest.raises(TLSFileError, match=rf"private key .*{tls.CA_KEY_FILE} not found"):
        ClusterCA.load(tmp_path)


def test_load_corrupt_certificate(tmp_path: Path) -> None:
    ClusterCA.create(tmp_path)
    (tmp_path / tls.CA_CERT_FILE).write_text("-----BEGIN CERTIFICATE-----\ngarbage\n")
    with pytest.raises(TLSFileError, match="is not a PEM certificate"):
        ClusterCA.load(tmp_path)


def test_load_corrupt_key(tmp_path: Path) -> None:
    ClusterCA.create(tmp_path)
    (tmp_path / tls.CA_KEY_FILE).write_text("not a key")
    (tmp_path / tls.CA_KEY_FILE).chmod(0o600)
    with pytest.raises(TLSFileError, match="is not an unencrypted PEM private key"):
        ClusterCA.load(tmp_path)


def test_load_refuses_a_key_readable_by_others(tmp_path: Path) -> None:
    ClusterCA.create(tmp_path)
    (tmp_path / tls.CA_KEY_FILE).chmod(0o644)
    with pytest.raises(TLSFileError, match=r"readable by others \(mode 0644\).*chmod 600"):
        ClusterCA.load(tmp_path)


def test_load_refuses_key_of_another_ca(tmp_path: Path) -> None:
    ClusterCA.create(tmp_path / "a")
    ClusterCA.create(tmp_path / "b")
    (tmp_path / "a" / tls.CA_KEY_FILE).write_bytes((tmp_path / "b" / tls.CA_KEY_FILE).read_bytes())
    with pytest.raises(TLSFileError, match="is not the key of"):
        ClusterCA.load(tmp_path / "a")


def test_load_refuses_a_leaf_certificate_as_ca(tmp_path: Path, ca: ClusterCA) -> None:
    issued = ca.issue("node", "n1")
    tmp_path.joinpath(tls.CA_CERT_FILE).write_bytes(issued.cert_pem)
    key = tmp_path / tls.CA_KEY_FILE
    key.write_bytes(issued.key_pem)
    key.chmod(0o600)
    with pytest.raises(TLSFileError, match="is not a CA certificate"):
        ClusterCA.load(tmp_path)


# --- issuing ------------------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
def test_issue_round_trips_role_and_name(ca: ClusterCA, role: Role) -> None:
    issued = ca.issue(role.value, "worker-1.example")
    assert identity_of(issued.cert_pem) == Identity(role, "worker-1.example")
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    # and in DER form, as getpeercert(binary_form=True) hands it over
    assert identity_of(cert.public_bytes(serialization.Encoding.DER)).role is role
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == role.value
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "worker-1.example"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"llmgw://{role.value}/worker-1.example" in sans.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    cert.verify_directly_issued_by(ca.certificate)
    # the key is the certificate's
    key = serialization.load_pem_private_key(issued.key_pem, password=None)
    assert key.public_key() == cert.public_key()


def test_control_certificate_carries_addresses_and_server_usage(ca: ClusterCA) -> None:
    issued = ca.issue(Role.CONTROL, "cp1", sans=["10.0.0.5", "cp1.example.org", "::1", "10.0.0.5"])
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("::1")
    ]
    assert sans.get_values_for_type(x509.DNSName) == ["cp1.example.org"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


@pytest.mark.parametrize("role", [Role.NODE, Role.ADMIN])
def test_node_and_admin_certificates_are_client_only(ca: ClusterCA, role: Role) -> None:
    cert = x509.load_pem_x509_certificate(ca.issue(role, "x").cert_pem)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(ValueError, match="only control plane certificates carry addresses"):
        ca.issue(role, "x", sans=["10.0.0.1"])


def test_issue_validity_window(ca: ClusterCA) -> None:
    start = datetime.datetime(2030, 1, 1, tzinfo=UTC)
    cert = x509.load_pem_x509_certificate(ca.issue("node", "n1", days=3, not_before=start).cert_pem)
    assert cert.not_valid_before_utc == start
    assert cert.not_valid_after_utc == start + datetime.timedelta(days=3)
    default = x509.load_pem_x509_certificate(ca.issue("node", "n1").cert_pem)
    now = datetime.datetime.now(UTC)
    assert default.not_valid_before_utc < now < default.not_valid_after_utc
    assert default.not_valid_after_utc - default.not_valid_before_utc == datetime.timedelta(
        days=tls.CERT_VALIDITY_DAYS
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "root", "name": "x"}, "unknown role 'root': expected one of control, node, admin"),
        ({"role": "node", "name": "has space"}, "invalid name 'has space'"),
        ({"role": "node", "name": ""}, "invalid name ''"),
        ({"role": "node", "name": "-x"}, "invalid name '-x'"),
        ({"role": "node", "name": "x", "days": 0}, "days must be at least 1"),
        ({"role": "control", "name": "x", "sans": ["bad host!"]}, "'bad host!' is neither"),
    ],
)
def test_issue_refuses_bad_input(ca: ClusterCA, kwargs: dict, message: str) -> None:
    role, name = kwargs.pop("role"), kwargs.pop("name")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ca.issue(role, name, **kwargs)


def _sign(ca: ClusterCA, subject: list[x509.NameAttribute], uris: list[str]) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            critical=False,
        )
    return builder.sign(ca._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_identity_of_refuses_inconsistent_or_foreign_certificates(ca: ClusterCA) -> None:
    ou_node = x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "node")
    cn = x509.NameAttribute(NameOID.COMMON_NAME, "n1")
    with pytest.raises(PermissionError, match="subject says node 'n1' but its SAN says"):
        identity_of(_sign(ca, [ou_node, cn], ["llmgw://admin/n1"]))
    with pytest.raises(PermissionError, match="not an llmgw identity certificate"):
        identity_of(_sign(ca, [cn], []))
    with pytest.raises(PermissionError, match="not an llmgw identity certificate"):
        identity_of(_sign(ca, [ou_node, cn], []))
    bad_role = x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "root")
    with pytest.raises(PermissionError, match="unknown role 'root'"):
        identity_of(_sign(ca, [bad_role, cn], ["llmgw://root/n1"]))


class _FakePeer:
    def __init__(self, der: bytes | None) -> None:
        self.der = der

    def getpeercert(self, binary_form: bool = False) -> bytes | None:
        assert binary_form
        return self.der


def test_peer_identity_without_certificate() -> None:
    with pytest.raises(PermissionError, match="presented no certificate"):
        tls.peer_identity(_FakePeer(None))


# --- credentials directories ----------------------------------------------------------------


def test_write_and_read_credentials(tmp_path: Path, ca: ClusterCA) -> None:
    issued = ca.issue("node", "gpu-07")
    directory = write_credentials(tmp_path / "tls", ca.cert_pem, issued)
    assert mode(directory) == 0o700
    assert mode(directory / tls.KEY_FILE) == 0o600
    assert mode(directory / tls.CERT_FILE) == 0o644
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]  # no temp leftovers
    creds = read_credentials(directory)
    assert creds.identity == Identity(Role.NODE, "gpu-07")
    assert creds.cert_pem == issued.cert_pem
    assert creds.ca_pem == ca.cert_pem
    # explicit paths (as agent.yaml gives them) read the same
    same = read_credentials(directory / tls.CA_CERT_FILE, directory / tls.CERT_FILE,
                            directory / tls.KEY_FILE)
    assert same == creds
    # re-issuing replaces the pair in place
    write_credentials(directory, ca.cert_pem, ca.issue("node", "gpu-08"))
    assert read_credentials(directory).identity.name == "gpu-08"
    assert "key_pem" not in repr(issued) and "key_pem" not in repr(creds)


def test_read_credentials_refuses_certificate_of_another_ca(
    tmp_path: Path, ca: ClusterCA, other_ca: ClusterCA
) -> None:
    write_credentials(tmp_path, ca.cert_pem, other_ca.issue("node", "n1"))
    with pytest.raises(TLSFileError, match="was not issued by the CA in .*copy this cluster's CA"):
        read_credentials(tmp_path)


def test_read_credentials_refuses_mismatched_key(tmp_path: Path, ca: ClusterCA) -> None:
    write_credentials(tmp_path, ca.cert_pem, ca.issue("node", "n1"))
    (tmp_path / tls.KEY_FILE).write_bytes(ca.issue("node", "n1").key_pem)
    with pytest.raises(TLSFileError, match=f"{tls.KEY_FILE} is not the key of"):
        read_credentials(tmp_path)


def test_read_credentials_missing_file_names_it(tmp_path: Path, ca: ClusterCA) -> None:
    write_credentials(tmp_path, ca.cert_pem, ca.issue("node", "n1"))
    (tmp_path / tls.CERT_FILE).unlink()
    with pytest.raises(TLSFileError, match=rf"certificate .*{tls.CERT_FILE} not found: issue"):
        read_credentials(tmp_path)


def test_read_credentials_key_too_open(tmp_path: Path, ca: ClusterCA) -> None:
    write_credentials(tmp_path, ca.cert_pem, ca.issue("node", "n1"))
    (tmp_path / tls.KEY_FILE).chmod(0o640)
    with pytest.raises(TLSFileError, match=r"mode 0640"):
        read_credentials(tmp_path)


# --- contexts -------------------------------------------------------------------------------


def test_server_context_requires_client_certificates(ca: ClusterCA) -> None:
    issued = ca.issue("control", "cp1", sans=["127.0.0.1"])
    context = server_ssl_context(ca.cert_pem, issued.cert_pem, issued.key_pem)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert len(context.get_ca_certs()) == 1


def test_client_context_checks_the_server(ca: ClusterCA) -> None:
    issued = ca.issue("node", "n1")
    context = client_ssl_context(ca.cert_pem, issued.cert_pem, issued.key_pem)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert not context.hostname_checks_common_name
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    loose = client_ssl_context(ca.cert_pem, issued.cert_pem, issued.key_pem, check_hostname=False)
    assert not loose.check_hostname and loose.verify_mode == ssl.CERT_REQUIRED


def test_contexts_refuse_unusable_pem(ca: ClusterCA) -> None:
    a, b = ca.issue("node", "a"), ca.issue("node", "b")
    with pytest.raises(TLSFileError, match="do not belong together"):
        client_ssl_context(ca.cert_pem, a.cert_pem, b.key_pem)
    with pytest.raises(TLSFileError, match="cluster CA certificate is not valid PEM"):
        server_ssl_context(b"junk", a.cert_pem, a.key_pem)


# --- authorisation --------------------------------------------------------------------------


def test_require_role_messages() -> None:
    node_a = Identity(Role.NODE, "a")
    require_role(node_a, "node")
    require_role(node_a, Role.NODE, "a")
    require_role(node_a, ["admin", "node"])
    with pytest.raises(PermissionError) as info:
        require_role(node_a, "admin")
    assert str(info.value) == "certificate of node 'a' cannot act as admin"
    with pytest.raises(PermissionError) as info:
        require_role(node_a, "node", "b")
    assert str(info.value) == "certificate is for node 'a', but it tried to join as node 'b'"
    with pytest.raises(PermissionError) as info:
        require_role(Identity(Role.NODE, "a"), [Role.CONTROL, Role.ADMIN])
    assert str(info.value) == "certificate of node 'a' cannot act as admin or control"
    with pytest.raises(PermissionError) as info:
        require_role(Identity(Role.ADMIN, "alice"), "admin", "bob")
    assert str(info.value) == "certificate is for admin 'alice', but it tried to act as admin 'bob'"
    with pytest.raises(ValueError, match="unknown role"):
        require_role(node_a, "superuser")


# --- explanations (real network cases are in tests/component/test_tls_streams.py) ------------


def _ssl_error(reason: str, text: str, cls: type[ssl.SSLError] = ssl.SSLError) -> ssl.SSLError:
    err = cls(1, f"[SSL: {reason}] {text} (_ssl.c:1)")
    err.reason = reason
    return err


def test_explain_alerts_seen_by_the_client() -> None:
    unknown_ca = _ssl_error("TLSV1_ALERT_UNKNOWN_CA", "tlsv1 alert unknown ca")
    message = explain_tls_error(unknown_ca, side="client", peer="10.0.0.5:7070")
    assert message.startswith("the server refused this machine's certificate (server 10.0.0.5:7070)")
    assert "not issued by the cluster's CA" in message and "llmgw ctl certs issue" in message
    required = _ssl_error("TLSV13_ALERT_CERTIFICATE_REQUIRED", "tlsv13 alert certificate required")
    assert "configure tls.cert and tls.key" in explain_tls_error(required, side="client")
    expired = _ssl_error("SSLV3_ALERT_CERTIFICATE_EXPIRED", "sslv3 alert certificate expired")
    assert "has expired" in explain_tls_error(expired, side="client")


def test_explain_follows_the_cause_chain() -> None:
    class BrokenResourceError(Exception):
        pass

    try:
        try:
            raise _ssl_error("UNEXPECTED_EOF_WHILE_READING", "EOF occurred", ssl.SSLEOFError)
        except ssl.SSLError as exc:
            raise BrokenResourceError() from exc
    except BrokenResourceError as wrapped:
        message = explain_tls_error(wrapped, side="client")
    assert message.startswith("the server closed the connection during or right after the TLS")
    assert "issued by the cluster's CA" in message


def test_explain_unrelated_errors_and_bad_side() -> None:
    assert "ConnectionRefusedError" in explain_tls_error(ConnectionRefusedError(111, "refused"),
                                                         side="client")
    with pytest.raises(ValueError, match="side must be"):
        explain_tls_error(OSError(), side="middle")  # type: ignore[arg-type]
