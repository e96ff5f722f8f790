"""mxfp8_learner_grid.vllm_plugin: vLLM adapter over ``mxfp8_learner_grid.common``."""
