"""mxfp8_learner_grid.patches: every runtime patch of an engine, each checking the version it was written for."""
