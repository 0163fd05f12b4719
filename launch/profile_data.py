"""`python -m launch.profile_data` from a checkout: fedjax_pfedes/launch/profile_data.py."""
from fedjax_pfedes.launch.profile_data import console

if __name__ == "__main__":
    console()
