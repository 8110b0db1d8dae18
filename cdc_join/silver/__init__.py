"""The silver table: what defines its rows, their keyed MERGE with stale-record rejection, and
the differences a full recompute writes (``table``).

May import: the base modules, ``storage`` and ``join`` (the value hashes); nothing of checks,
run or cli.
"""
