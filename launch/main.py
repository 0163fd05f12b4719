"""`python -m launch.main` from a checkout: fedjax_pfedes/launch/main.py."""
from fedjax_pfedes.launch.main import console

if __name__ == "__main__":
    console()
