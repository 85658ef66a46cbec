"""`server.tls_cert`/`server.tls_key`: the gRPC port serves TLS only."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from rollout_api.client import connect
from rollout_api.proto import rollout_pb2
from tests.rollout_server.conftest import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.slow  # starts server processes


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_server(server_factory, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server = server_factory(
        [f"server.tls_cert={cert}", f"server.tls_key={key}", "rollout.batch_groups=1"]
    )
    channel, stub = connect(server.address, MAX_MESSAGE_BYTES, root_certificates=cert.read_bytes())
    assert stub.Health(rollout_pb2.HealthRequest(), timeout=30).live
    channel.close()
    plain, stub = connect(server.address, MAX_MESSAGE_BYTES)
    with pytest.raises(grpc.RpcError) as e:
        stub.Health(rollout_pb2.HealthRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
