"""``python -m cli``: the ``edgeinfer`` command."""
import sys

from cli import main

sys.exit(main())
