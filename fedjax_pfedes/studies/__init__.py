"""Research tooling above the engine: multi-seed experiments, vectorized sweeps, findings F1-F7,
round budgets, gradient inversion."""
