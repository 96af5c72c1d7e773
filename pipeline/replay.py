"""`python -m pipeline.replay`: the command; `pipeline.evaluation.replay` holds it."""

import sys

from pipeline.evaluation.replay import main

if __name__ == "__main__":
    sys.exit(main())
