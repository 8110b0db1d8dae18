"""Landing folders → bronze, exactly once per file.

``listing`` finds a landing folder's new files and reads their lines; ``debezium/`` decodes
Debezium's envelopes, ops, sequence positions and column values; ``ingest`` writes a batch's
events to bronze and its bad lines to quarantine, exactly once per file, and ``outcome`` counts
what a parsed batch comes to; ``bronze`` is what a run reads back: the change feed since the
checkpoint. ``event_writer`` writes Debezium event files (the demo's, the tests').

May import: the base modules (``config``, ``errors``, ``schemas``, ``changeset`` …), ``storage``
and ``checkpoint``; nothing of the join, silver, checks, run or cli.
"""
