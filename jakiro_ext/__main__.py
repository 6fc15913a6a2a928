"""``python -m jakiro_ext``: see :mod:`jakiro_ext.cli`."""
import sys

from jakiro_ext.cli import main

if __name__ == "__main__":
    sys.exit(main())
