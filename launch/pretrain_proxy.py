"""`python -m launch.pretrain_proxy` from a checkout: fedjax_pfedes/launch/pretrain_proxy.py."""
from fedjax_pfedes.launch.pretrain_proxy import console

if __name__ == "__main__":
    console()
