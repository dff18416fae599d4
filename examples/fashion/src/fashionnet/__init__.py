"""fashionnet: a user's own model, preprocessing and data pipeline, trained by the runner."""
