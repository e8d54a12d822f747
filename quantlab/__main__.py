"""`python -m quantlab ...` is the `quantlab` command."""
import sys

from .cli import main

sys.exit(main())
