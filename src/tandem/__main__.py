"""`python -m tandem ...` (and `torchrun -m tandem train RECIPE.yaml`): the `tandem` command line."""

from tandem.cli import main

main()
