"""`python -m pipeline.evaluate`: the command; `pipeline.evaluation.heldout` holds it."""

import sys

from pipeline.evaluation.heldout import main

if __name__ == "__main__":
    sys.exit(main())
