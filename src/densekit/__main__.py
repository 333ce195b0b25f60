"""`python -m densekit` (and `torchrun -m densekit`) runs the command line."""

from densekit.cli import main

main()
