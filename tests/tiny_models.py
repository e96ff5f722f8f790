"""The tests' tiny models: see mxfp8_learner_grid.common.tiny_model."""

from mxfp8_learner_grid.common.tiny_model import build_model, make_tokenizer, save_model  # noqa: F401
