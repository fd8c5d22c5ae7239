"""`python -m tether ...`: the `tether` command."""

from tether.coordinator.cli import main

main()
