"""`python -m launch.budget` from a checkout: fedjax_pfedes/launch/budget.py."""
from fedjax_pfedes.launch.budget import console

if __name__ == "__main__":
    console()
