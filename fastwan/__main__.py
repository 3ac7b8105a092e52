"""``python -m fastwan ...`` is the ``fastwan`` command (:func:`fastwan.cli.main`), its exit code included."""
import sys

from fastwan.cli import main

if __name__ == "__main__":
    sys.exit(main())
