"""`python -m h3gen.cli`: the `h3gen` command."""

import sys

from h3gen.cli import main

if __name__ == "__main__":
    sys.exit(main())
