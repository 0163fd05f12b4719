"""`python -m launch.leakage` from a checkout: fedjax_pfedes/launch/leakage.py."""
from fedjax_pfedes.launch.leakage import console

if __name__ == "__main__":
    console()
