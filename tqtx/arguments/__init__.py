"""The arguments of the public API, checked before anything is sent or written.

* :mod:`.kinds` -- what one argument accepts (text, keys, paths, numbers, fields ...) and the
  error that names it.
* :mod:`.table` -- for every function of the module API, which kind each argument is.

Torch-free; the client, deploy and dump layers use the kinds, the API the table.
"""
