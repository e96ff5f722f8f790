"""mxfp8_learner_grid.sglang_plugin: SGLang adapter over ``mxfp8_learner_grid.common``."""
