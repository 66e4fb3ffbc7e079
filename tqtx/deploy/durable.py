"""The deployment's durability setting: decided once where a deployment starts, handed to
every server process through its environment.

Sources, first wins: the ``tq.init`` config keys ``durability``, ``flush_interval_s`` and
``unit_data_dir``; the variables ``TQTX_DURABILITY``, ``TQTX_FLUSH_INTERVAL_S`` and
``TQTX_UNIT_DATA_DIR`` of the config's ``env``, then of the starting process's environment;
the defaults (``"controller"``, 1.0 s, ``<state_dir>/units``). A value of an earlier release
(``"full"``, ``"normal"``, ``"off"``) is mapped with one DeprecationWarning where it is
read; the servers get the mapped value (:meth:`DurabilitySetting.env`), so none of them
warns again.

``unit_data_dir``: a relative path is taken relative to the state dir, a ``~`` path is the
home directory of the node that runs the unit (expanded there on Ray).
"""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from .. import durability as dur
from ..layout import paths

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by this module's caller that names the first
    frame outside tqtx (the user's ``tq.init``), so Python's default filters show it."""
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def mapped(value, what: str = "durability") -> str:
    """``value`` as a current durability setting: an earlier value mapped to its replacement
    with a DeprecationWarning naming ``what`` (a config key or an environment variable) and
    pointing at the caller outside tqtx; ValueError naming ``what`` for anything else."""
    try:
        new = dur.check(value, warn=False)
    except ValueError:
        raise ValueError(f"{what} {value!r}: expected one of "
                         f"{', '.join(map(repr, dur.DURABILITY))}") from None
    if new != value:
        warnings.warn(f"{what} {value!r} is deprecated; use {new!r} (docs/reliability.md, "
                      f"Durability)", DeprecationWarning, stacklevel=_user_stacklevel())
    return new


def normalise_config(cfg: dict) -> dict:
    """``cfg`` (a checked ``tq.init`` config) with an earlier ``durability`` value mapped
    (one DeprecationWarning)."""
    if cfg.get("durability") is not None:
        cfg["durability"] = mapped(cfg["durability"], "config key 'durability'")
    return cfg


@dataclass(frozen=True)
class DurabilitySetting:
    """What a deployment runs with: ``durability``, ``flush_interval_s`` and
    ``unit_data_dir`` (as given: None means ``<state_dir>/units``)."""

    durability: str = dur.DEFAULT
    flush_interval_s: float = dur.FLUSH_INTERVAL_S
    unit_data_dir: str | None = None

    def unit_data_base(self, state_dir: str, *, expand_user: bool = True) -> str:
        """The directory the units' ``unit-<k>/`` data directories go under.
        ``expand_user=False`` leaves a ``~`` path for the unit's node to expand."""
        return unit_data_base(self.unit_data_dir, state_dir, expand_user=expand_user)

    def env(self, state_dir: str, *, expand_user: bool = True) -> dict[str, str]:
        """The environment variables every server process of the deployment gets."""
        return {dur.ENV_DURABILITY: self.durability,
                dur.ENV_FLUSH_INTERVAL: repr(float(self.flush_interval_s)),
                dur.ENV_UNIT_DATA_DIR: self.unit_data_base(state_dir, expand_user=expand_user)}

    def config(self) -> dict:
        """The setting as ``tq.init`` config keys."""
        return {"durability": self.durability, "flush_interval_s": self.flush_interval_s,
                "unit_data_dir": self.unit_data_dir}

    def record(self, state_dir: str) -> dict:
        """The owner record's fields (``deployment.json``)."""
        return {"durability": self.durability, "flush_interval_s": self.flush_interval_s,
                "unit_data_dir": self.unit_data_base(state_dir, expand_user=False)}


def unit_data_base(value, state_dir: str, *, expand_user: bool = True) -> str:
    """``value`` (None: the default) as the absolute base of the units' data directories:
    relative to ``state_dir``; ``~`` expanded here unless ``expand_user`` is False."""
    if value is None or not os.fspath(value).strip():
        return os.fspath(paths.unit_data_root(os.path.abspath(state_dir)))
    text = os.fspath(value)
    if text.startswith("~"):
        if not expand_user:
            return text
        text = os.path.expanduser(text)
    return os.path.abspath(os.path.join(os.path.abspath(state_dir), text))


def resolve(cfg: Mapping | None = None, environ: Mapping | None = None) -> DurabilitySetting:
    """The setting of a deployment started with config ``cfg`` (its ``env`` included) from a
    process whose environment is ``environ`` (default ``os.environ``). ValueError naming the
    key or the variable for a value that is refused."""
    cfg = cfg or {}
    env = {**(os.environ if environ is None else environ), **(cfg.get("env") or {})}
    durability = dur.DEFAULT
    if cfg.get("durability") is not None:
        durability = mapped(cfg["durability"], "config key 'durability'")
    elif env.get(dur.ENV_DURABILITY):
        durability = mapped(env[dur.ENV_DURABILITY], f"${dur.ENV_DURABILITY}")
    interval = dur.FLUSH_INTERVAL_S
    try:
        if cfg.get("flush_interval_s") is not None:
            interval = dur.check_interval(cfg["flush_interval_s"])
        elif env.get(dur.ENV_FLUSH_INTERVAL):
            interval = dur.check_interval(env[dur.ENV_FLUSH_INTERVAL])
    except ValueError as exc:
        where = ("config key" if cfg.get("flush_interval_s") is not None
                 else f"${dur.ENV_FLUSH_INTERVAL}:")
        raise ValueError(f"{where} {exc}") from None
    data_dir = cfg.get("unit_data_dir")
    if data_dir is None:
        data_dir = env.get(dur.ENV_UNIT_DATA_DIR) or None
    return DurabilitySetting(durability, interval,
                             os.fspath(data_dir) if data_dir is not None else None)
