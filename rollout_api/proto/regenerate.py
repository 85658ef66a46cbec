"""Regenerates rollout_pb2.py / rollout_pb2_grpc.py from rollout.proto with grpcio-tools.

python -m rollout_api.proto.regenerate            # rewrite the committed files
python -m rollout_api.proto.regenerate --out DIR  # write elsewhere (the freshness test)
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

from grpc_tools import protoc

PROTO_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Generates into `out_dir/rollout_api/proto/` and returns the two module paths."""
    include = protoc.__file__.rsplit("/", 1)[0] + "/_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / "rollout.proto").replace(str(REPO_ROOT) + "/", ""),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    target = out_dir / "rollout_api" / "proto"
    return [target / "rollout_pb2.py", target / "rollout_pb2_grpc.py"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="output root (default: the repository)")
    args = parser.parse_args()
    if args.out:
        for path in generate(pathlib.Path(args.out)):
            print(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(pathlib.Path(tmp)):
            (PROTO_DIR / path.name).write_bytes(path.read_bytes())
            print(PROTO_DIR / path.name)


if __name__ == "__main__":
    main()
