"""``python -m mgk`` is the ``mgk`` command."""
import sys

from .cli import main

sys.exit(main())
