"""`python -m tandem.cli`, as `tandem`."""

from tandem.cli import main

main()
