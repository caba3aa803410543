"""How it trains: what ``lora=`` asks for, the activation memory of a LoRA step, and the training
plan by fit (memory savers, micro-batch). Uses ``planning/model/``, the budgets and the vocabulary."""
