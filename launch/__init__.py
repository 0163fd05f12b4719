"""The command lines, run from a checkout (`python -m launch.main --config=configs/...`); the code
is in `fedjax_pfedes/launch/`, and an installed package provides them as console scripts
(`fedjax-pfedes`, `fedjax-pfedes-compare`, ...)."""
