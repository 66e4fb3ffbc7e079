"""Features turned off from the environment: one spelling of "off" for every switch
(``0``, ``off``, ``false``, ``no``, in any case). Torch-free, stdlib only."""
from __future__ import annotations

import os

OFF = ("0", "off", "false", "no")


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` turns its feature off (unset: on)."""
    return os.environ.get(env, "").strip().lower() in OFF
