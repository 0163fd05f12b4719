"""`python -m launch.findings` from a checkout: fedjax_pfedes/launch/findings.py."""
from fedjax_pfedes.launch.findings import console

if __name__ == "__main__":
    console()
