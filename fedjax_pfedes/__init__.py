"""fedjax_pfedes: a JAX/Flax simulator for model-heterogeneous personalized federated learning.

The flagship algorithm is pFedES (proxy feature extractor sharing); see
`fedjax_pfedes.algorithms.pfedes`.
"""

__version__ = "0.1.0"
