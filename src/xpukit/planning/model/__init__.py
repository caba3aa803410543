"""What the model is: its facts read from the config (sizes, layers, class), its shape, and where
the named reference models come from. The lowest sub-wing of planning above the vocabulary."""
