"""``python -m llmgw.sim``: run a simulated vLLM engine (see ``--help``)."""

import sys

from llmgw.sim.config import parse_args
from llmgw.sim.server import main

if __name__ == "__main__":
    sys.exit(main(parse_args()))
