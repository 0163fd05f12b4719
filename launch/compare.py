"""`python -m launch.compare` from a checkout: fedjax_pfedes/launch/compare.py."""
from fedjax_pfedes.launch.compare import console

if __name__ == "__main__":
    console()
