"""A run, wired: ``pipeline`` (the one short place that wires a run), ``plan`` (the one place
that picks its path), ``paths`` (what each path does), ``cost`` (the cost rule), ``fence`` (the
versions every write must find), ``runlog`` (a run's start, commit and lock) and
``maintenance`` (compaction, from file statistics).

May import: everything but ``cli``.
"""
