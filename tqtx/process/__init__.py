"""Server processes as the operating system sees them (torch-free; below the wire layer).

* :mod:`.servers` -- what the controller and unit processes share with the code that starts
  them: their command lines, the parent watch, the ready announcement, stopping a child.
* :mod:`.pids` -- which process a pid is (its start time), so a record outlives pid reuse.
* :mod:`.logutil` -- logging that a full disk cannot turn into a flood.
* :mod:`.gcpause` -- the cyclic garbage collector paused while a call builds many objects.
"""
