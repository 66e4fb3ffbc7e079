"""The client side of moving data to and from disk: a selective dump by key (:mod:`.save`),
a transactional restore by key (:mod:`.load`) and the whole-system checkpoint
(:mod:`.checkpoint`). Each is driven from the calling process; the units write and read
the payload files in the dump format (:mod:`tqtx.format`), published by
:mod:`tqtx.journal.publish`."""
