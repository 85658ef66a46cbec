"""``python -m train --config configs/NAME.yaml [dotted.key=value ...]`` (same as ``sat-train``)."""

from train.main import cli

if __name__ == "__main__":
    cli()
