"""The host-rows benchmark (benchmarks/host_rows.py): its argument checks, and a small batch whose
per-process part shrinks with the process count while the [B] fields and lags stay whole."""

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import host_rows as bench  # noqa: E402


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "6", "--processes", "4"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err


def test_each_process_is_sent_only_its_rows_of_the_per_token_fields():
    rows, tokens, layers, top_k = 8, 64, 4, 2
    argv = [
        "--rows",
        "8",
        "--tokens",
        "64",
        "--layers",
        "4",
        "--top-k",
        "2",
        "--processes",
        "2",
        "4",
    ]
    out = bench.main_cli(argv)
    # tokens int32, loss mask uint8, behavior log-probs float32, routing uint8 [L, K] per token
    per_row = tokens * (4 + 1 + 4 + layers * top_k)
    for p, (whole, part) in out.items():
        left_out = rows - rows // p
        # What is not sent is exactly the other processes' rows, less the two .npz entries per
        # per-token field (4 of them) that name the rows sent and the whole shape (< 512 bytes
        # each: the zip and .npy headers and a few int64s).
        assert 0 <= left_out * per_row - (whole - part) < 4 * 2 * 512, (p, whole, part)
