"""The command lines: `python -m launch.NAME` from a checkout (thin modules in `launch/` that call
these), or the console scripts an installed package provides (`fedjax-pfedes` for `main`,
`fedjax-pfedes-NAME` for the others)."""
