"""Developer tools that are neither tests nor benchmarks (the behaviour recorder)."""
