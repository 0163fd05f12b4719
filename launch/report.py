"""`python -m launch.report` from a checkout: fedjax_pfedes/launch/report.py."""
from fedjax_pfedes.launch.report import console

if __name__ == "__main__":
    console()
