"""mixscope models: config, token mixers, decoder, caches, checkpoints, generation."""
