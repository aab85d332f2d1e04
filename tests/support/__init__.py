"""What the tests share: the deployment (over control/bench/harness.py), waiting on a
state, extra gateways, `keybatch up` as a child, tiny models, the hang-up server."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
