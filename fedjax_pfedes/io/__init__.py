"""What a run reads and writes: checkpoints, metrics files, the workdir lock, the run report and
its plots."""
