"""How a cohort's per-client functions run over its participants: the strategy registry and runners
(`runners`), offloaded client states, the automatic choice, compilation cache and multi-process
runs."""
