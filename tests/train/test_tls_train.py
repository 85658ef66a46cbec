"""A trainer trains against a TLS rollout server that requires a token (`train.tls_ca`,
`server.token`; docs/DESIGN.md §10), with a self-signed certificate made here."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.train.test_main import CONFIG, _env
from train.local_server import LocalServer

pytestmark = pytest.mark.slow  # starts a server and a trainer


def self_signed(directory) -> tuple[str, str]:
    """(key, certificate) PEM paths of a certificate for 127.0.0.1 and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def test_a_tls_trainer_trains_against_a_tls_server(tmp_path):
    key, cert = self_signed(tmp_path)
    shared = [
        "rollout.batch_groups=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "server.slots=4",
        "server.token=s3cret",
        f"server.checkpoint_root={tmp_path}",
    ]
    server_only = [
        f"server.tls_cert={cert}",
        f"server.tls_key={key}",
        f"server.state_dir={tmp_path / 'state'}",
    ]
    run_dir = tmp_path / "run"
    with LocalServer(CONFIG, [*shared, *server_only], str(tmp_path / "server.log")) as server:
        server.wait_ready(timeout_s=150, root_certificates=open(cert, "rb").read())
        out = subprocess.run(
            [sys.executable, "-m", "train", "--config", CONFIG, *shared,
             f"train.client.servers=[{server.address}]", f"train.tls_ca={cert}", "train.steps=2",
             "train.eval.problems=0", "train.warmup.steps=0", f"train.run_dir={run_dir}"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 2 steps" in out.stdout, out.stdout
    assert (run_dir / "run_id").read_text().strip()
