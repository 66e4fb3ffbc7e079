"""Features turned off (or forced on) from the environment: one spelling of "off" for every
switch (``0``, ``off``, ``false``, ``no``, in any case), and of "on" (``1``, ``on``,
``true``, ``yes``). Torch-free, stdlib only."""
from __future__ import annotations

import os

OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes")


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` turns its feature off (unset: on)."""
    return os.environ.get(env, "").strip().lower() in OFF


def switched_on(env: str) -> bool:
    """Whether the environment variable ``env`` forces its feature on (for a feature whose
    default depends on the machine)."""
    return os.environ.get(env, "").strip().lower() in ON
