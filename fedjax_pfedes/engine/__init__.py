"""The simulation engine: who takes part, one round as a pure function of `SimState`, evaluation,
everything static of a run (`build`) and the host loop over rounds (`loop`)."""
