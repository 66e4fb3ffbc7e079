"""Where tqtx's files are and how they reach the disk (a torch-free leaf: it imports nothing
from tqtx).

* :mod:`.paths` -- every file name tqtx uses beside a dump, inside a dump or checkpoint, and
  in a state dir, and the probes on them (is a controller running, what may be replaced).
* :mod:`.fsutil` -- durable file I/O: fsync helpers, the fsynced small-file writer, writev and
  pread loops.
* :mod:`.pages` -- huge pages for the fresh memory reads go into (read regions, get results).
* :mod:`.libc` -- the C library, loaded once, for the calls Python has no binding of.
* :mod:`.switches` -- features turned off (or forced on) from the environment, one spelling each.
"""
