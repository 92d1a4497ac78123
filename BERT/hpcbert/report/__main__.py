"""python -m hpcbert.report ... (the same as `hpcbert report ...`)."""

from .cli import main

main()
