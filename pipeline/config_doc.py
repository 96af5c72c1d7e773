"""`python -m pipeline.config_doc`: the command; `pipeline.config.doc` holds it."""

import sys

from pipeline.config.doc import main

if __name__ == "__main__":
    sys.exit(main())
