"""cossd beside the frameworks its optimizers run under (DeepSpeed)."""
