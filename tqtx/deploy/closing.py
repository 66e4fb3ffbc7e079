"""How the process that started a deployment ends it at ``tq.close()``.

In order: the controller discards the journaled metadata (END_BUFFER: the buffer ends with
its units; a crash keeps it, docs/journal.md); each unit is sent SHUTDOWN
``{"keep_buffer": false}`` and deletes its row log (durability ``"buffer"`` / ``"sync"``);
then the deployment stops its processes (units first, then the controller). In that order
a crash part-way leaves row logs whose puts are no longer committed (the next start drops
them), never committed metadata whose rows are gone. ``keep_buffer=True`` skips the first
step and asks the units to keep their logs: the next ``init`` on the state dir finds the
buffer as after a whole-job crash. A controller that does not answer gets no END_BUFFER,
and the units no SHUTDOWN: they are stopped by signal and keep what they hold.
"""
from __future__ import annotations

import logging

log = logging.getLogger("tqtx.init")


def close_deployment(client, deployment, *, keep_buffer: bool = False) -> None:
    """End ``deployment`` (this process started it) through ``client``; see the module."""
    answered = False
    try:
        answered = end_buffer(client, keep_buffer)
        if answered:
            shutdown_units(client, keep_buffer)
    finally:
        adopted = answered and getattr(deployment, "controller_replaced", bool)()
        deployment.stop()
        if adopted:
            stop_adopted_controller(client, deployment)


def end_buffer(client, keep_buffer: bool = False) -> bool:
    """END_BUFFER (``keep_buffer``: only PING, the metadata stays journaled); whether the
    controller answered."""
    try:
        client.controller.call("PING" if keep_buffer else "END_BUFFER", timeout=10)
        return True
    except Exception as exc:  # noqa: BLE001 - closing must not fail on a dead controller
        log.warning("close: the controller did not %s: %s",
                    "answer" if keep_buffer else "discard the buffer's metadata", exc)
        return False


def shutdown_units(client, keep_buffer: bool) -> None:
    """SHUTDOWN every unit with ``{"keep_buffer": keep_buffer}``, all at once. A unit that
    does not answer is stopped by the deployment's stop, keeping its row log."""
    from ..wire.peer import call_many
    body = {"keep_buffer": bool(keep_buffer)}
    calls = [(client.unit(uid), "SHUTDOWN", body) for uid in range(len(client.unit_addresses))]
    for uid, out in enumerate(call_many(calls, timeout=10, raise_first=False)):
        if isinstance(out, BaseException):
            log.warning("close: unit %d did not take SHUTDOWN: %s", uid, out)


def stop_adopted_controller(client, deployment) -> None:
    """The controller this process started exited and another one, restarted by hand on the
    deployment's state dir and port, took its place and ended the buffer: stop it as close
    stops its own (after the units), so the state dir is free for the next ``init``."""
    try:
        client.controller.call("SHUTDOWN", timeout=10)
    except Exception as exc:  # noqa: BLE001 - it may have gone by itself meanwhile
        log.warning("close: the controller at %s that replaced this deployment's did not "
                    "take SHUTDOWN: %s", client.address, exc)
        return
    if not deployment.wait_state_dir_free(timeout=10):
        log.warning("close: the controller at %s still holds %s/controller.lock 10 s after "
                    "SHUTDOWN", client.address, deployment.state_dir)
