"""Is silver right? ``verify`` recomputes the join from bronze and compares it with silver (and
the internal tables); ``quality_config`` and ``quality`` are the pipeline's ``quality:`` checks
on the rows a run touched.

May import: the base modules, ``storage``, ``checkpoint``, ``landing``, ``join`` and ``silver``;
nothing of run or cli.
"""
