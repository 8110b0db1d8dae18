"""The KIP-213 hops, from a run's bronze increment to the silver rows of the keys it affects.

In the order a run takes them: ``increment`` (what the increment changes: keys, truncates),
``images`` (each changed key's old and new row), ``apply`` (the state step: images computed in
one Spark job, rows appended), ``state`` (the state table itself: newest row per key),
``subscription`` (KIP-213's instructions and the CombinedKey table), ``lookup`` (right changes →
their subscribers; right rows named by foreign keys), ``resolve`` (the stale check on value
hashes → silver rows), ``collect`` (nested children), with ``hashing`` (the value hashes) and
``rebuild`` (a source's state from its whole bronze table).

May import: the base modules, ``storage``, ``checkpoint`` and ``landing`` (bronze increments);
nothing of silver, checks, run or cli.
"""
