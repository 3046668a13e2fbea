"""Vision encoders and projectors: an image in, the language model's input embeddings for its
placeholder tokens out. They sit beside the language model, never inside it."""
