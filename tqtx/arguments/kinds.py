"""The argument kinds of the public API: what one argument accepts (:class:`Kind` and its
kinds: text, keys, paths, numbers, flags, dicts, fields ...) and the message a refused value
gets (``TypeError`` for a wrong type, ``ValueError`` for a right type with a wrong value,
naming the function, the argument, what it got and what it accepts); UTF-8 checks of
strings. The table of which function takes which kind is :mod:`tqtx.arguments.table`; the keys of
``tq.init``'s config are checked with the same kinds in :mod:`tqtx.deploy.initconfig`.

A torch-free leaf (standard library only): a TensorDict is recognised by its type's module.
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping

# Keys, partition IDs and field names longer than this are refused: no real one comes near,
# and the controller keeps (and journals) every key.
MAX_NAME_CHARS = 65536
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


# --------------------------------------------------------------------------- strings
def check_utf8(what: str, values) -> None:
    """ValueError naming the first str of ``values`` that is not valid UTF-8 (a lone
    surrogate such as ``"\\udcff"``, e.g. from ``os.fsdecode`` of a non-UTF-8 file name),
    so it is refused before anything is sent instead of failing inside msgpack."""
    if isinstance(values, str):
        values = (values,)
    try:
        "".join(values).encode("utf-8")  # one pass; surrogates never pair across a join
        return
    except UnicodeEncodeError:
        pass
    for v in values:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what}: {v!r} is not valid UTF-8 ({exc.reason}: "
                             f"{v[exc.start]!r} at position {exc.start})") from None


def _utf8_problem(value: str) -> str | None:
    try:
        value.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return (f"not valid UTF-8 ({exc.reason}: {value[exc.start]!r} at position "
                f"{exc.start})")


def shown(value, limit: int = 80) -> str:
    """``value`` for an error message: its type and a repr cut to ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not hide the real error
        text = "<unprintable>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return f"{type(value).__name__} {text}"


class Refused(Exception):
    """What a kind says about a value it does not accept: the exception type to raise and,
    optionally, why (else the message says what was got)."""

    def __init__(self, exc_type: type, why: str = ""):
        super().__init__(why)
        self.exc_type, self.why = exc_type, why


# --------------------------------------------------------------------------- kinds
class Kind:
    """What one argument accepts. ``says`` completes "<name> must be ..."."""

    says = ""

    def refuse(self, value) -> None:
        """Raise :class:`Refused` if ``value`` is not accepted."""

    def refuse_quietly(self, value) -> bool:
        """Whether ``value`` is refused (no message)."""
        try:
            self.refuse(value)
            return False
        except Refused:
            return True

    def check(self, where: str, name: str, value) -> None:
        try:
            self.refuse(value)
        except Refused as r:
            raise r.exc_type(f"{where}: {name} must be {self.says}; got "
                             f"{r.why or shown(value)}") from None


class Maybe(Kind):
    """None, or what ``inner`` accepts."""

    def __init__(self, inner: Kind):
        self.inner = inner
        self.says = f"{inner.says} (or None)"

    def refuse(self, value) -> None:
        if value is not None:
            self.inner.refuse(value)


class Text(Kind):
    """A str, valid UTF-8, at most ``limit`` characters; non-blank unless ``blank``."""

    def __init__(self, says: str = "a non-blank str", *, blank: bool = False,
                 limit: int = MAX_NAME_CHARS, spaces: bool = True):
        self.says, self.blank, self.limit, self.spaces = says, blank, limit, spaces

    def refuse(self, value) -> None:
        if not isinstance(value, str):
            raise Refused(TypeError)
        if not self.blank and not value.strip():
            raise Refused(ValueError, f"{value!r} (empty or only whitespace)")
        if not self.spaces and any(c.isspace() for c in value):
            raise Refused(ValueError, f"{value!r} (contains whitespace)")
        if len(value) > self.limit:
            raise Refused(ValueError, f"a str of {len(value)} characters (at most "
                                      f"{self.limit})")
        bad = _utf8_problem(value)
        if bad:
            raise Refused(ValueError, f"{value!r}, {bad}")


class Choice(Kind):
    """One of ``values`` (str); ``also``: values still accepted but not named (deprecated)."""

    def __init__(self, *values: str, also: tuple[str, ...] = ()):
        self.values, self.also = values, tuple(also)
        self.says = "one of " + ", ".join(repr(v) for v in values)

    def refuse(self, value) -> None:
        if not isinstance(value, str):
            raise Refused(TypeError)
        if value not in self.values and value not in self.also:
            raise Refused(ValueError)


class Flag(Kind):
    """True or False (not 0, 1, "no" or None: a truthy string would silently mean yes)."""

    says = "True or False"

    def refuse(self, value) -> None:
        if not isinstance(value, bool):
            raise Refused(TypeError)


class Number(Kind):
    """A finite real (or an int, with ``integer``), not a bool, within ``low``..``high``;
    ``above`` is an exclusive lower bound."""

    def __init__(self, says: str, *, integer: bool = False, low=None, high=None, above=None):
        self.says, self.integer, self.low, self.high, self.above = says, integer, low, high, above

    def refuse(self, value) -> None:
        kind = numbers.Integral if self.integer else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            raise Refused(TypeError)
        if not self.integer and not math.isfinite(value):
            raise Refused(ValueError)
        if ((self.low is not None and value < self.low)
                or (self.high is not None and value > self.high)
                or (self.above is not None and value <= self.above)):
            raise Refused(ValueError)


class PathArg(Kind):
    """A path: str or os.PathLike of a str (a bytes path is refused, as TransferQueue's
    ``Path(...)`` refuses it), non-blank (an empty path would mean the working directory),
    without NUL, at most ``MAX_PATH_CHARS`` characters."""

    says = "a non-empty path (str or os.PathLike)"

    def refuse(self, value) -> None:
        if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
            raise Refused(TypeError)
        try:
            path = os.fspath(value)
        except TypeError:
            raise Refused(TypeError) from None
        if not isinstance(path, str):
            raise Refused(TypeError)
        if not path.strip():
            raise Refused(ValueError, f"{value!r} (an empty path would mean the working "
                                      f"directory)")
        if "\0" in path:
            raise Refused(ValueError, f"{shown(value)} (contains a NUL character)")
        if len(path) > MAX_PATH_CHARS:
            raise Refused(ValueError, f"a path of {len(path)} characters (at most "
                                      f"{MAX_PATH_CHARS})")
        bad = _utf8_problem(path)
        if bad:
            raise Refused(ValueError, f"{value!r}, {bad}")


class Keys(Kind):
    """Keys (or field names): one str if ``one`` (one key, as in TransferQueue), else a
    container of ``containers`` holding only str; empty only if ``empty``; distinct if
    ``distinct``. Each str is valid UTF-8 and at most ``MAX_NAME_CHARS`` characters."""

    def __init__(self, says: str, *, one: bool = True, empty: bool = False,
                 distinct: bool = True, containers: tuple = (list,)):
        self.says, self.one, self.empty, self.distinct = says, one, empty, distinct
        self.containers = containers

    def refuse(self, value) -> None:
        if isinstance(value, str):
            if not self.one:
                raise Refused(TypeError, f"{shown(value)} (one str is not a list of keys)")
            self._refuse_items([value])
            return
        if not isinstance(value, self.containers):
            raise Refused(TypeError)
        items = list(value)
        if not items and not self.empty:
            raise Refused(ValueError, f"an empty {type(value).__name__}")
        self._refuse_items(items)

    def _refuse_items(self, items: list) -> None:
        try:  # one pass each: join takes only str, encode refuses lone surrogates
            joined = "".join(items)
        except TypeError:
            i, bad = next((i, k) for i, k in enumerate(items) if not isinstance(k, str))
            raise Refused(TypeError, f"{shown(bad)} at [{i}]") from None
        total = len(joined)
        try:
            joined.encode("utf-8")
        except UnicodeEncodeError:
            i, bad = next((i, k) for i, k in enumerate(items) if _utf8_problem(k))
            raise Refused(ValueError, f"{bad!r} at [{i}], {_utf8_problem(bad)}") from None
        if total > MAX_NAME_CHARS:
            i, long = next(((i, k) for i, k in enumerate(items) if len(k) > MAX_NAME_CHARS),
                           (None, None))
            if long is not None:
                raise Refused(ValueError, f"a str of {len(long)} characters at [{i}] (at "
                                          f"most {MAX_NAME_CHARS})")
        if self.distinct and len(set(items)) != len(items):
            seen, dups = set(), []
            for k in items:
                if k in seen:
                    dups.append(k)
                seen.add(k)
            raise Refused(ValueError, f"duplicate keys in one call: {dups[:10]}")


class Dict(Kind):
    """A dict (any Mapping); its values are checked where they are encoded."""

    def __init__(self, says: str = "a dict"):
        self.says = says

    def refuse(self, value) -> None:
        if not isinstance(value, Mapping):
            raise Refused(TypeError)


class JsonDict(Dict):
    """A dict that JSON can write (``save_checkpoint``'s ``metadata``)."""

    def __init__(self):
        super().__init__("a dict JSON can write")

    def refuse(self, value) -> None:
        super().refuse(value)
        import json
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise Refused(TypeError, f"{shown(value)} ({exc})") from None


class Tags(Kind):
    """One tag per key: a list (or tuple) of dicts (None: an empty tag)."""

    says = "a list of dicts (one per key, None for an empty tag)"

    def refuse(self, value) -> None:
        if not isinstance(value, (list, tuple)):
            raise Refused(TypeError)
        for i, tag in enumerate(value):
            if tag is not None and not isinstance(tag, Mapping):
                raise Refused(TypeError, f"{shown(tag)} at [{i}]")


def is_tensordict(value) -> bool:
    """Whether ``value`` is a TensorDict (or another tensordict batch), without importing it."""
    return (type(value).__module__.split(".", 1)[0] == "tensordict"
            and hasattr(value, "batch_size"))


class Fields(Kind):
    """A put's fields: a dict of field name -> value or a TensorDict. ``exc`` is raised for
    a value of another type (kv_put: a ValueError that is also a TypeError, because
    TransferQueue raises ValueError there)."""

    def __init__(self, says: str, exc: type = TypeError):
        self.says, self.exc = says, exc

    def refuse(self, value) -> None:
        if is_tensordict(value):
            return
        if not isinstance(value, Mapping):
            raise Refused(self.exc)
        for name in value:
            if not isinstance(name, str):
                raise Refused(TypeError, f"a field name {shown(name)} (field names are str)")
            if not name or len(name) > MAX_NAME_CHARS or _utf8_problem(name):
                why = _utf8_problem(name) or "empty or too long"
                raise Refused(ValueError, f"a field name {shown(name)} ({why})")


class Meta(Kind):
    """A KVBatchMeta: ``keys`` (a list of str), ``partition_id``, ``fields``."""

    says = "a KVBatchMeta (keys, partition_id, fields)"
    _keys = Keys("a list of str")
    _partition = Maybe(Text("a non-blank str"))
    _fields = Maybe(Keys("a list of str", one=False, empty=True, distinct=False))

    def refuse(self, value) -> None:
        if not all(hasattr(value, a) for a in ("keys", "partition_id", "fields")) \
                or isinstance(value, Mapping):
            raise Refused(TypeError)
        for attr, kind in (("keys", self._keys), ("partition_id", self._partition),
                           ("fields", self._fields)):
            try:
                kind.refuse(getattr(value, attr))
            except Refused as r:
                raise Refused(r.exc_type, f"meta.{attr} {r.why or shown(getattr(value, attr))}"
                                          f" (must be {kind.says})") from None


class Parser(Kind):
    """``data_parser``: None. A callable is refused by the function itself with
    NotImplementedError (it would ship code to the units); anything else is a TypeError."""

    says = "None (tqtx takes no data_parser)"

    def refuse(self, value) -> None:
        if value is not None and not callable(value):
            raise Refused(TypeError)


class Config(Kind):
    """``tq.init``'s config: a dict or an OmegaConf DictConfig (its keys: tqtx.deploy.initconfig)."""

    says = "a dict or an OmegaConf DictConfig"

    def refuse(self, value) -> None:
        if not isinstance(value, Mapping) and type(value).__module__.split(".")[0] != "omegaconf":
            raise Refused(TypeError)


class Address(Kind):
    """A controller address ``tcp://host:port`` (port 1-65535)."""

    says = "a controller address 'tcp://host:port' (port 1-65535)"

    def refuse(self, value) -> None:
        if not isinstance(value, str):
            raise Refused(TypeError)
        host, sep, port = value.removeprefix("tcp://").rpartition(":")
        if (not value.startswith("tcp://") or not sep or not host.strip("[]")
                or any(c.isspace() for c in value) or not port.isdigit()
                or not 1 <= int(port) <= 65535):
            raise Refused(ValueError)
