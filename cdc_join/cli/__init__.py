"""The ``cdc-join`` command (``main``), ``status`` and ``plan`` reports, and the demo.

May import: everything.
"""
