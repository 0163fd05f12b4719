"""`python -m launch.sweep_heterogeneity` from a checkout: the package's sweep_heterogeneity."""
from fedjax_pfedes.launch.sweep_heterogeneity import console

if __name__ == "__main__":
    console()
