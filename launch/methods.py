"""`python -m launch.methods` from a checkout: fedjax_pfedes/launch/methods.py."""
from fedjax_pfedes.launch.methods import console

if __name__ == "__main__":
    console()
