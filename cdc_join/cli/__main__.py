"""``python -m cdc_join.cli``: the ``cdc-join`` command."""

import sys

from cdc_join.cli.main import main

sys.exit(main())
