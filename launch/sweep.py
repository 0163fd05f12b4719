"""`python -m launch.sweep` from a checkout: fedjax_pfedes/launch/sweep.py."""
from fedjax_pfedes.launch.sweep import console

if __name__ == "__main__":
    console()
