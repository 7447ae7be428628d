"""``python -m async_stager`` (also the ``async-stager`` script): see ``_cli.main``."""

import sys

from ._cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
