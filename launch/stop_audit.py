"""`python -m launch.stop_audit` from a checkout: fedjax_pfedes/launch/stop_audit.py."""
from fedjax_pfedes.launch.stop_audit import console

if __name__ == "__main__":
    console()
