"""`python -m pipeline.launch`, with every generation of the embedded engine written down: one
JSON line per generation (the ids it was given, the ids it generated, their log-probs and
versions) appended to the file $STRATA_TEST_GENERATIONS. The end-to-end agent runs hold the
trained trajectories against it, byte for byte (tests/pipeline/test_agent_run.py)."""

import json
import os
import sys

from actors import embedded
from pipeline.launch import main

_generate = embedded.EmbeddedEngine.generate


async def _recorded(self, prompt_ids, params):
    generation = await _generate(self, prompt_ids, params)
    record = [list(prompt_ids), generation.token_ids, generation.logprobs, generation.versions]
    with open(os.environ["STRATA_TEST_GENERATIONS"], "a") as out:
        out.write(json.dumps(record) + "\n")
    return generation


if __name__ == "__main__":
    embedded.EmbeddedEngine.generate = _recorded
    sys.exit(main(sys.argv[1:]))
