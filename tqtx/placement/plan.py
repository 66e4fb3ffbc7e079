"""Which Ray node each unit goes to (pure: reads ``ray.nodes()``-shaped dicts, no Ray import).

As TransferQueue 0.1.11 does for its storage units: hard-pinned, round-robin over the
alive nodes in node-ID order, optionally only nodes advertising a positive amount of one
custom resource. Unlike a ``SPREAD`` placement group (best effort) or ``STRICT_SPREAD``
(fails with more units than nodes), every node gets floor or ceil(N / nodes) units; a
node whose CPUs are all taken by earlier units is skipped, and a plan that cannot fit
fails at once, naming what is missing, instead of waiting for Ray.
"""
from __future__ import annotations

import math

from ..errors import TqtxError


class RayPlacementError(TqtxError):
    """The Ray cluster cannot host the deployment asked for (nothing is left running)."""


def node_label(node_id: str, ip: str | None) -> str:
    """A node as errors and logs show it: the first 8 hex digits of its ID and its IP."""
    return f"{node_id[:8]} ({ip})" if ip else node_id[:8]


def plan_units(nodes: list[dict], num_units: int, resource: str | None,
               num_cpus: float) -> list[dict]:
    """One alive node per unit, round-robin in node-ID order, never more units on a node
    than its CPUs hold. Raises RayPlacementError naming what is missing."""
    alive = sorted((n for n in nodes if n.get("Alive")), key=lambda n: n["NodeID"])
    if not alive:
        raise RayPlacementError("the Ray cluster has no alive node")
    eligible = [n for n in alive if not resource or n["Resources"].get(resource, 0) > 0]
    if not eligible:
        have = sorted({r for n in alive for r in n["Resources"] if not r.startswith("node:")})
        raise RayPlacementError(
            f"no alive Ray node has the resource {resource!r} asked for by unit_node_resource "
            f"({len(alive)} alive nodes, resources: {have})")
    slots = [math.inf if num_cpus <= 0 else math.floor(n["Resources"].get("CPU", 0) / num_cpus
                                                         + 1e-9) for n in eligible]
    if sum(slots) < num_units:
        where = ", ".join(f"{node_label(n['NodeID'], n.get('NodeManagerAddress'))}: "
                          f"{n['Resources'].get('CPU', 0):g} CPU" for n in eligible)
        raise RayPlacementError(
            f"{num_units} units of {num_cpus:g} CPU each (ray_num_cpus) do not fit on the "
            f"{len(eligible)} eligible node(s)"
            + (f" with resource {resource!r}" if resource else "")
            + f" ({where}): at most {sum(slots)} fit; lower num_units or ray_num_cpus, or add "
              f"nodes")
    plan, used, i = [], [0] * len(eligible), 0
    while len(plan) < num_units:
        k = i % len(eligible)
        i += 1
        if used[k] < slots[k]:
            used[k] += 1
            plan.append(eligible[k])
    return plan
