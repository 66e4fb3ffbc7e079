"""``tqtx demo``: the main job end to end, verified value by value.

1. start an embedded deployment with ``--units-before`` units;
2. fill a partition with a partial-rollout buffer (jagged prompt/response token ids,
   jagged log-probs, scalar rewards, a text field, tags with status/step/policy_version);
3. mark ~40% of the samples ``finished`` (tag-only batch put);
4. dump the unfinished ones with :func:`tqtx.dump_data_by_key`, then :func:`tqtx.close`;
5. start again with ``--units-after`` units on a fresh state dir and
   :func:`tqtx.load_data_by_key` the dump;
6. check every value, dtype, shape and tag against the reference kept in this process,
   and that no finished sample came back.

Exit code 0 only when the verification passed.

Modules: :mod:`.data` (the sample buffer), :mod:`.run` (arguments and the scenario
steps), :mod:`.checks` (value-by-value verification, journal records), :mod:`.report`
(the printed summary), :mod:`.console` (quiet console output).
"""
from .run import main

__all__ = ["main"]
