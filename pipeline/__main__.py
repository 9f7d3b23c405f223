"""`python -m pipeline`: the command line of pipeline/cli.py."""

from pipeline.cli import main

main()
